"""The operator's settings: one validated model, flags over RELAYTRAIN_* variables."""

from __future__ import annotations

import pytest
from relaytrain_operator.loop.options import OperatorOptions, parse_options

pytestmark = pytest.mark.unit


def test_defaults_come_from_the_model_and_the_environment() -> None:
    assert parse_options([], {}) == OperatorOptions()
    env = {
        "RELAYTRAIN_NAMESPACES": "team-a,ml-*",
        "RELAYTRAIN_RESYNC_SECONDS": "2.5",
        "RELAYTRAIN_MAX_WORKERS": "3",
        "RELAYTRAIN_METRICS_PORT": "0",
        "RELAYTRAIN_DEBUG": "1",
        "RELAYTRAIN_PEERING": "",
        "RELAYTRAIN_KUEUE": "1",
    }
    opts = parse_options([], env)
    assert opts.namespaces == ("team-a", "ml-*")
    assert (opts.resync_seconds, opts.max_workers, opts.metrics_port) == (2.5, 3, 0)
    assert opts.debug and opts.peering is None and opts.kueue
    assert parse_options(["--kueue"], {}).kueue and not parse_options([], {}).kueue


def test_flags_win_over_the_environment() -> None:
    opts = parse_options(
        ["--namespace", "x", "--resync-seconds", "1", "--node-lost-seconds", "5", "--peering", "p"],
        {"RELAYTRAIN_RESYNC_SECONDS": "30"},
    )
    assert (opts.namespaces, opts.resync_seconds, opts.node_lost_seconds) == (("x",), 1.0, 5.0)
    assert opts.peering == "p"


def test_a_bad_value_is_a_usage_error_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_options(["--resync-seconds", "0", "--max-workers", "x"], {})
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--resync-seconds: Input should be greater than 0" in err
    assert "--max-workers: Input should be a valid integer" in err


def test_options_are_frozen() -> None:
    with pytest.raises(ValueError, match="frozen"):
        OperatorOptions().resync_seconds = 1  # type: ignore[misc]


def test_which_namespaces_an_operator_serves() -> None:
    everything = parse_options([], {})
    assert everything.serves("any") and not everything.globbed
    named = parse_options(["--namespace", "team-a", "--namespace", "team-b"], {})
    assert not named.globbed and named.patterns == ("team-a", "team-b")
    assert named.serves("team-b") and not named.serves("team-c")
    globs = parse_options([], {"RELAYTRAIN_NAMESPACES": "team-*,!*-test"})
    assert globs.globbed and globs.patterns == ("team-*", "!*-test")
    assert globs.serves("team-a") and not globs.serves("team-a-test")
    assert not globs.serves("other") and globs.serves(None)  # a node: cluster-scoped
    only_out = parse_options(["--namespace", "!kube-*"], {})
    assert only_out.serves("team-a") and not only_out.serves("kube-system")


def test_stage_pods_are_told_where_to_compute(capsys: pytest.CaptureFixture[str]) -> None:
    from relaytrain_contract import DEVICE_ENV
    from relaytrain_testkit.stage_pods import pod_for

    assert parse_options([], {}).worker_device == "cuda"
    assert parse_options([], {"RELAYTRAIN_WORKER_DEVICE": "cpu"}).worker_device == "cpu"

    def device(pod: dict[str, object]) -> object:
        (container,) = pod["spec"]["containers"]  # type: ignore[index]
        return {e["name"]: e.get("value") for e in container["env"]}[DEVICE_ENV]

    assert device(pod_for(0)) == "cuda"
    assert device(pod_for(0, device="cpu")) == "cpu"
    with pytest.raises(SystemExit):
        parse_options(["--worker-device", "gpu"], {})
    assert "--worker-device: Input should be 'cuda', 'cpu' or 'auto'" in capsys.readouterr().err
