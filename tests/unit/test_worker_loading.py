"""A stage loads only its own tensors, and says clearly when the model cannot give them."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from relaytrain_testkit.tiny_models import tiny_model_dir
from relaytrain_worker.model import model_slice
from relaytrain_worker.model.model_slice import SliceSpec, build_stage_model
from relaytrain_worker.model.shards import ModelLoadError

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("m"), layers=6, max_shard_size="30KB")


def _weight_map(model_dir: Path) -> dict[str, str]:
    return json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]


def test_a_middle_stage_opens_only_the_shards_of_its_layers(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    opened: list[str] = []
    real = model_slice.safe_open

    def spy(path: str, **kwargs: object) -> object:
        opened.append(Path(path).name)
        return real(path, **kwargs)

    monkeypatch.setattr(model_slice, "safe_open", spy)
    stage = build_stage_model(model_dir, SliceSpec(2, 4, False, False))
    wm = _weight_map(model_dir)
    wanted = {s for n, s in wm.items() if n.startswith(("model.layers.2.", "model.layers.3."))}
    assert set(opened) == wanted
    assert len(wanted) < len(set(wm.values()))
    assert [i for i, _ in stage.layer_items()] == [2, 3]
    names = {n for n, _ in stage.model.named_parameters()}
    assert not any(
        "embed_tokens" in n or "lm_head" in n or n.startswith("model.norm") for n in names
    )


def test_the_last_stage_of_a_tied_model_reads_the_embedding_as_its_head(model_dir: Path) -> None:
    first = build_stage_model(model_dir, SliceSpec(0, 3, True, False))
    last = build_stage_model(model_dir, SliceSpec(3, 6, False, True))
    assert last.model.lm_head.weight.data_ptr() != first.inner.embed_tokens.weight.data_ptr()
    assert (last.model.lm_head.weight == first.inner.embed_tokens.weight).all()


def test_layers_the_model_does_not_have_are_refused(model_dir: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"layers \[4, 9\).*has 6 decoder layers"):
        build_stage_model(model_dir, SliceSpec(4, 9, False, True))


def _copy(model_dir: Path, tmp_path: Path) -> Path:
    import shutil

    target = tmp_path / "model"
    shutil.copytree(model_dir, target)
    return target


def test_a_missing_shard_is_named(model_dir: Path, tmp_path: Path) -> None:
    copy = _copy(model_dir, tmp_path)
    shard = _weight_map(copy)["model.layers.1.mlp.up_proj.weight"]
    (copy / shard).unlink()
    with pytest.raises(ModelLoadError, match=f"model shard {shard} is missing"):
        build_stage_model(copy, SliceSpec(0, 2, True, False))
    # A stage whose tensors live elsewhere still loads.
    build_stage_model(copy, SliceSpec(4, 6, False, True))


def test_a_truncated_shard_is_named(model_dir: Path, tmp_path: Path) -> None:
    copy = _copy(model_dir, tmp_path)
    shard = _weight_map(copy)["model.layers.5.self_attn.q_proj.weight"]
    data = (copy / shard).read_bytes()
    (copy / shard).write_bytes(data[: len(data) - 100])
    with pytest.raises(ModelLoadError, match=f"model shard {shard} is truncated"):
        build_stage_model(copy, SliceSpec(4, 6, False, True))


def test_a_directory_without_a_model_is_named(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        build_stage_model(tmp_path, SliceSpec(0, 1, True, True))


_RSS_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import torch, transformers, accelerate, peft  # imports before the baseline
    from relaytrain_worker.model.model_slice import SliceSpec, build_stage_model
    start, end, layers = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    base = status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the high-water mark: measure the load, not the imports
    stage = build_stage_model(Path(sys.argv[1]), SliceSpec(start, end, start == 0, end == layers))
    for p in stage.parameters():
        float(p.sum())  # touch every weight, as training does (shards may be memory-mapped)
    peak = status("VmHWM")
    print(json.dumps({"base": base, "peak": peak}))
    """
)


@pytest.mark.slow
def test_peak_memory_of_a_stage_tracks_its_share(tmp_path: Path) -> None:
    # 8 layers of ~12.6 MB each (hidden 512, fp32), a tiny vocabulary: a quarter of the
    # layers must cost about a quarter of the memory of all of them.
    model_dir = tiny_model_dir(
        tmp_path, layers=8, hidden=512, intermediate=1376, max_shard_size="20MB", tied=False
    )
    layer_bytes = sum(p.stat().st_size for p in model_dir.glob("*.safetensors")) / 8

    def start(first: int, end: int) -> subprocess.Popen[str]:
        argv = [sys.executable, "-c", _RSS_SCRIPT, str(model_dir), str(first), str(end), "8"]
        return subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)

    def grown(proc: subprocess.Popen[str]) -> float:
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out
        doc = json.loads(out.strip().splitlines()[-1])
        return float(doc["peak"] - doc["base"])

    # Each process measures its own peak: the two run side by side.
    procs = start(2, 4), start(0, 8)
    quarter, whole = (grown(p) for p in procs)
    assert quarter < 0.4 * whole, (quarter, whole)
    assert quarter < 3.5 * layer_bytes * 2, (quarter, layer_bytes)


def test_from_s3_a_stage_fetches_only_the_shards_of_its_layers(model_dir: Path) -> None:
    from relaytrain_contract import StageConfig
    from relaytrain_testkit.stage_document import DOC
    from relaytrain_worker.state.modelfiles import stage_shards

    wm = _weight_map(model_dir)

    def holding(*prefixes: str) -> set[str]:
        return {shard for name, shard in wm.items() if name.startswith(prefixes)}

    doc = {**DOC, "stage": {"index": 1, "count": 3, "layerStart": 2, "layerEnd": 4}}
    middle = stage_shards(wm, StageConfig.from_json(doc), tied=True)
    assert middle == holding("model.layers.2.", "model.layers.3.")
    last = {**doc, "stage": {"index": 2, "count": 3, "layerStart": 4, "layerEnd": 6},
            "links": {**DOC["links"], "next": None, "nextIdentity": None}}  # fmt: skip
    shards = stage_shards(wm, StageConfig.from_json(last), tied=True)
    # The tied head reads the embedding; nothing of layers 0-3 unless it shares a shard.
    assert shards == holding("model.layers.4.", "model.layers.5.", "model.norm.",
                             "model.embed_tokens.")  # fmt: skip
    assert len(shards) < len(set(wm.values()))
