"""Which tests a `-m` expression can reach: `make test-fast` leaves the modules that need torch
uncollected (not imported) only where no test in them could be selected."""

from __future__ import annotations

import pytest
from relaytrain_testkit import REPO
from relaytrain_testkit.tiers import can_select, needs_torch

pytestmark = pytest.mark.unit

FAST = "not k8s and not e2e and not chaos and not gpu and not torch"


@pytest.mark.parametrize(
    ("markexpr", "selects_a_torch_test"),
    [
        (FAST, False),
        ("not torch", False),
        ("unit and not torch", False),
        ("", True),
        ("unit", True),  # a unit test that needs torch
        ("unit or contract", True),
        ("torch", True),
        ("not torch or unit", True),  # a torch test marked unit too
        ("not (torch and unit)", True),  # a torch test not marked unit
        ("torch and not torch", False),
    ],
)
def test_a_torch_module_is_left_uncollected_only_where_no_torch_test_is_selected(
    markexpr: str, selects_a_torch_test: bool
) -> None:
    assert can_select(markexpr, "torch") is selects_a_torch_test


def test_modules_are_sorted_by_what_they_import() -> None:
    assert needs_torch(REPO / "tests" / "unit" / "test_boundary_delta.py")
    assert not needs_torch(REPO / "tests" / "unit" / "test_tiers.py")
