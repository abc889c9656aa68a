"""`make demo` keeps the working folders of its last few runs, not every run's."""

from __future__ import annotations

from pathlib import Path

import pytest

from hack.demo import prune_runs

pytestmark = pytest.mark.unit


def test_only_the_newest_runs_stay(tmp_path: Path) -> None:
    names = ["20261124-090000", "20261125-120000", "20261126-080000", "20261126-172524"]
    for name in reversed(names):  # made in another order than they are named
        (tmp_path / name / "pods").mkdir(parents=True)
    (tmp_path / "notes.txt").write_text("not a run")
    gone = prune_runs(tmp_path, 2)
    assert gone == [tmp_path / n for n in names[:2]]
    assert sorted(p.name for p in tmp_path.iterdir()) == [*names[2:], "notes.txt"]
    assert prune_runs(tmp_path, 2) == []
    assert prune_runs(tmp_path / "missing", 2) == []
    assert prune_runs(tmp_path, 0) == [tmp_path / n for n in names[2:]]
    with pytest.raises(ValueError, match="--keep-runs must be 0 or more"):
        prune_runs(tmp_path, -1)
