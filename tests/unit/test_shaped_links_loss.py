"""A lossy link's settings (relaytrain_testkit.shaped_links.Shaping.loss): a probability, said
in the namespace's description, and passed to the namespace's set-up; the e2e test
(tests/e2e/test_shaped_links.py) trains over such a link."""

from __future__ import annotations

import pytest
from relaytrain_testkit import shaped_links

pytestmark = pytest.mark.unit


def test_loss_is_a_probability_said_in_the_description_and_passed_on() -> None:
    lossy = shaped_links.Shaping(1e6, loss=0.02)
    assert lossy.describe().endswith(", 2.00% of packets lost")
    argv = shaped_links.command(["true"], lossy)
    assert argv[argv.index("--loss") + 1] == "0.02"
    assert "--loss" not in shaped_links.command(["true"], shaped_links.Shaping(1e6))
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="loss is a probability"):
            shaped_links.Shaping(1e6, loss=bad)
