"""What the exact LoRA merge folds into the frozen weights (`lora_merge.Fold`) is state: it
goes into checkpoints and comes back to the bit, a restore without it puts the model
file's weights back, a rejoining stage takes it from a live one, and a bf16 weight keeps
folds far below its rounding step (the weight is always the model file's plus the float32
sum, rounded once)."""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from relaytrain_testkit.tiny_models import tiny_model_dir
from relaytrain_worker.model.lora_merge import FOLD_FILE, Fold, lora_layers
from relaytrain_worker.model.methods import apply_lora, lora_config
from relaytrain_worker.model.training import make_optimizer
from relaytrain_worker.pipeline.rollback import (
    load_by_name,
    load_files,
    reset_weights,
    stage_files,
)
from relaytrain_worker.replicas.arithmetic import InProcessGroup
from relaytrain_worker.replicas.periodic import FOLDS, PeriodicSync
from relaytrain_worker.state.checkpoint import save_stage, try_commit
from relaytrain_worker.state.export import export_output, load_adapter_output
from relaytrain_worker.state.store import LocalStore

pytestmark = pytest.mark.unit

TRAINING: Any = SimpleNamespace(
    learning_rate=1e-3, weight_decay=0.0, schedule="constant", warmup_steps=0, steps=10
)


TARGETS = ["q_proj", "v_proj"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("llama"), layers=2)


def _plain(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)


@pytest.fixture(scope="module")
def base(model_dir: Path) -> torch.nn.Module:
    model = _plain(model_dir)
    apply_lora(model, lora_config(4, 8.0, 0.0, TARGETS), seed=1)
    return model


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: m.base_layer.weight.detach().clone() for n, m in lora_layers(model).items()}


def _folded(model: torch.nn.Module, seed: int = 0) -> Fold:
    """`model`'s Fold after two merges' folds into each of its layers."""
    fold = Fold(model)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(2):
        for name, layer in fold.layers.items():
            shape = layer.base_layer.weight.shape
            fold.add(name, torch.randn(shape, generator=gen) * 1e-3)
    return fold


def _trainable(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if ".lora_" in n]


def _cfg(start: int, end: int) -> Any:
    return SimpleNamespace(
        stage=SimpleNamespace(index=0, layer_start=start, layer_end=end),
        method=SimpleNamespace(type="lora"),
        training=SimpleNamespace(seed=1),
    )


def test_a_checkpoint_restores_the_folded_weights_to_the_bit(base: torch.nn.Module) -> None:
    saved, restored = copy.deepcopy(base), copy.deepcopy(base)
    fold = _folded(saved)
    assert all(not torch.equal(w, _weights(base)[n]) for n, w in _weights(saved).items())
    trainable = _trainable(saved)
    optimizer, scheduler = make_optimizer(trainable, TRAINING)
    files = stage_files(_cfg(0, 2), 4, trainable, optimizer, scheduler, fold=fold)
    assert FOLD_FILE in files

    again = Fold(restored)
    mine = _trainable(restored)
    load_files(files, mine, *make_optimizer(mine, TRAINING), again)
    for name, weight in _weights(saved).items():
        assert torch.equal(_weights(restored)[name], weight), name
    # A commit from before any fold (no fold file) puts the model file's weights back.
    plain = stage_files(_cfg(0, 2), 2, mine, *make_optimizer(mine, TRAINING), fold=Fold(base))
    assert FOLD_FILE not in plain
    load_files(plain, mine, *make_optimizer(mine, TRAINING), again)
    for name, weight in _weights(base).items():
        assert torch.equal(_weights(restored)[name], weight), name


def test_another_split_restores_each_layer_from_the_stage_that_held_it(
    base: torch.nn.Module,
) -> None:
    # Pipeline 0 held layer 0 on one stage and layer 1 on another; this stage holds both.
    saved = copy.deepcopy(base)
    fold = _folded(saved)
    parts = []
    for layer in (0, 1):
        mine = {m for m in fold.delta if f".layers.{layer}." in m}
        part = Fold(saved)
        part.delta = {m: fold.delta[m] for m in mine}
        trainable = [(n, p) for n, p in _trainable(saved) if f".layers.{layer}." in n]
        files = stage_files(_cfg(layer, layer + 1), 4, trainable,
                            *make_optimizer(trainable, TRAINING), fold=part)  # fmt: skip
        parts.append(files)
    restored = copy.deepcopy(base)
    trainable = _trainable(restored)
    load_by_name(parts, trainable, *make_optimizer(trainable, TRAINING), step=4, source=0,
                 fold=Fold(restored))  # fmt: skip
    for name, weight in _weights(saved).items():
        assert torch.equal(_weights(restored)[name], weight), name


def test_starting_over_puts_the_model_files_weights_back(
    base: torch.nn.Module, tmp_path: Path
) -> None:
    model = copy.deepcopy(base)
    fold = _folded(model)
    stage = SimpleNamespace(model=model)
    reset_weights(_cfg(0, 2), tmp_path, stage, fold)  # type: ignore[arg-type]
    assert not fold
    for name, weight in _weights(base).items():
        assert torch.equal(_weights(model)[name], weight), name


def test_a_rejoining_stage_takes_the_live_stages_fold(base: torch.nn.Module) -> None:
    live, joining = copy.deepcopy(base), copy.deepcopy(base)
    group = InProcessGroup([1, 1], timeout=10)
    names = [n for n, _ in _trainable(live)]
    sent = PeriodicSync(group, 0, 0, _trainable(live), every=2, total=10,
                        fold=_folded(live), exact=True).anchor_tensors(names)  # fmt: skip
    assert {k.removeprefix(FOLDS) for k in sent} == {f"{m}.weight" for m in lora_layers(live)}
    stale = _folded(joining, seed=7)  # what it restored from an older commit
    taker = PeriodicSync(group, 1, 0, _trainable(joining), every=2, total=10,
                         fold=stale, exact=True)  # fmt: skip
    taker.take_anchor(sent)
    for name, weight in _weights(live).items():
        assert torch.equal(_weights(joining)[name], weight), name
    # A live stage with nothing folded sends nothing, and the stale fold goes.
    empty = PeriodicSync(group, 0, 0, _trainable(base), every=2, total=10,
                         fold=Fold(copy.deepcopy(base)), exact=True)  # fmt: skip
    taker.take_anchor(empty.anchor_tensors(names))
    for name, weight in _weights(base).items():
        assert torch.equal(_weights(joining)[name], weight), name


def test_a_bf16_weight_keeps_folds_below_its_rounding_step(base: torch.nn.Module) -> None:
    model = copy.deepcopy(base).to(torch.bfloat16)
    before = _weights(model)
    fold = Fold(model)
    name, layer = next(iter(fold.layers.items()))
    weight = layer.base_layer.weight
    step = weight.detach().float().abs().max() * 2.0**-10  # under half a bf16 step of most
    for _ in range(64):
        fold.add(name, torch.full(weight.shape, float(step)) / float(layer.scaling["default"]))
    want = (before[name].float() + 64 * step).to(torch.bfloat16)
    assert torch.equal(weight.detach(), want)
    # Added to the weight one by one, each fold would have rounded away.
    naive = before[name].clone()
    for _ in range(64):
        naive += step.to(torch.bfloat16)
    assert (naive != want).float().mean() > 0.5


def test_a_4bit_weight_takes_no_fold() -> None:
    from relaytrain_worker.model.lora_merge import _foldable

    class Params4bit(torch.nn.Parameter):
        pass

    layer = SimpleNamespace(base_layer=SimpleNamespace(weight=Params4bit(torch.zeros(4, 4))))
    assert not _foldable(layer)  # type: ignore[arg-type]
    linear = SimpleNamespace(base_layer=torch.nn.Linear(4, 4))
    assert _foldable(linear)  # type: ignore[arg-type]


# peft 0.21.2's PeftModel.from_pretrained calls a transformers 5.23 API deprecated for v6.
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_the_output_loads_as_the_model_the_stages_trained(
    model_dir: Path, base: torch.nn.Module, tmp_path: Path
) -> None:
    from peft import PeftModel

    trained = copy.deepcopy(base)
    fold = _folded(trained)
    with torch.no_grad():
        for _, param in _trainable(trained):
            param.normal_(0, 0.1)
    cfg = SimpleNamespace(
        method=SimpleNamespace(type="lora", rank=4, alpha=8.0, dropout=0.0,
                               target_modules=TARGETS),
        model=SimpleNamespace(uri=str(model_dir)),
        stage=SimpleNamespace(index=0, layer_start=0, layer_end=2),
    )  # fmt: skip
    ckpt, out = LocalStore(tmp_path / "ckpt"), LocalStore(tmp_path / "output")
    trainable = _trainable(trained)

    def commit_and_export(step: int, fold: Fold) -> list[str]:
        files = stage_files(cfg, step, trainable, *make_optimizer(trainable, TRAINING), fold=fold)
        save_stage(ckpt, "ns/job", step, 0, files)
        assert try_commit(ckpt, "ns/job", step, 1)
        return export_output(cfg, ckpt, "ns/job", step=step, out=out, model_dir=model_dir)  # type: ignore[arg-type]

    assert FOLD_FILE in commit_and_export(4, fold)
    ids = torch.arange(10).reshape(1, 10)
    with torch.no_grad():
        want = trained(input_ids=ids).logits
        got = load_adapter_output(_plain(model_dir), tmp_path / "output")(input_ids=ids).logits
        assert torch.allclose(got, want, rtol=0, atol=1e-6)
        # The adapter alone is not what trained: the fold is part of the result.
        alone = PeftModel.from_pretrained(_plain(model_dir), str(tmp_path / "output"))
        assert not torch.allclose(alone(input_ids=ids).logits, want, rtol=0, atol=1e-4)
    # An output of a run that folded nothing drops an earlier run's fold from the place.
    assert FOLD_FILE not in commit_and_export(8, Fold(trained))
    assert not (tmp_path / "output" / FOLD_FILE).exists()
