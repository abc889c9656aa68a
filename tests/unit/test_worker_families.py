"""Every supported model family slices exactly.

Per family a tiny random model is built from the family's own transformers config class (no
hub), with the family's twist switched on and set so that it matters at this size (short
sliding windows, small soft-caps, far-apart rotary bases, multipliers far from 1). 2- and
3-stage pipelines train it with LoRA in fp32 over real links and must reproduce the unsplit
model's losses, clipped LoRA gradients and updated weights bit for bit; the adapter they
export must load with `PeftModel.from_pretrained` on the unsplit model and give the logits of
the unsplit model carrying the pipeline's LoRA weights.

Each family's twist is then taken out of the slices alone (never out of the reference) and
the same comparison must find a difference: a test that would pass without the twist would
not be checking it.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from relaytrain_contract.families import SUPPORTED_MODEL_TYPES, family, lora_targets
from relaytrain_testkit import pipelines
from relaytrain_testkit.inputs import CLIPPED_TRAINING, even_splits
from relaytrain_testkit.linkcreds import stage_credentials
from relaytrain_testkit.pipelines import PipelineRun, run_pipeline_threads
from relaytrain_testkit.references import run_reference
from relaytrain_testkit.tiny_families import LAYERS, family_config, tiny_family_dir
from relaytrain_worker.model import families
from relaytrain_worker.model.methods import apply_lora, lora_config
from relaytrain_worker.model.model_slice import StageModel, load_config
from relaytrain_worker.model.shards import ModelLoadError
from relaytrain_worker.state.data import MicroBatch
from relaytrain_worker.state.export import _export_adapter
from relaytrain_worker.state.store import LocalStore
from torch import nn

pytestmark = pytest.mark.unit

SEQ = 12
TRAINING = CLIPPED_TRAINING.model_copy(update={"steps": 2})
EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]
MOE_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", *EXPERTS]


def _targets(model_type: str) -> list[str]:
    return MOE_TARGETS if family(model_type).moe else ["all-linear"]


def _lora(model_type: str) -> dict[str, Any]:
    return {"rank": 4, "alpha": 8.0, "dropout": 0.0, "targets": _targets(model_type)}


def _steps(vocab: int, n_steps: int = 2, n_micro: int = 3) -> list[list[MicroBatch]]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n_steps):
        micros = []
        for _ in range(n_micro):
            ids = torch.randint(0, vocab, (2, SEQ), generator=gen)
            mask = torch.ones(2, SEQ, dtype=torch.long)
            mask[1, 9:] = 0  # right padding on one row
            labels = ids.clone()
            labels[mask == 0] = -100
            labels[0, :3] = -100  # a masked prompt
            pos = torch.arange(SEQ).expand(2, -1).contiguous()
            micros.append(MicroBatch(ids, mask, pos, labels))
        out.append(micros)
    return out


@dataclasses.dataclass
class Reference:
    model_dir: Path
    vocab: int
    run: PipelineRun


_REFERENCES: dict[str, Reference] = {}


@pytest.fixture
def reference(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The unsplit model's training run of a family (built once per family)."""

    def get(model_type: str) -> Reference:
        if model_type not in _REFERENCES:
            model_dir = tiny_family_dir(tmp_path_factory.mktemp(model_type), model_type)
            vocab = int(load_config(model_dir).vocab_size)
            run = run_reference(model_dir, _steps(vocab), TRAINING, lora=_lora(model_type))
            _REFERENCES[model_type] = Reference(model_dir, vocab, run)
        return _REFERENCES[model_type]

    return get


def _pipeline(ref: Reference, model_type: str, stages: int, n_steps: int = 2) -> PipelineRun:
    return run_pipeline_threads(
        ref.model_dir, even_splits(LAYERS, stages), _steps(ref.vocab)[:n_steps], TRAINING,
        credentials=stage_credentials(stages), lora=_lora(model_type),
    )  # fmt: skip


def _differences(run: PipelineRun, ref: PipelineRun, n_steps: int = 2) -> list[str]:
    """What of (losses, clipped LoRA gradients, updated weights) is not bit-identical."""
    out = []
    for step in range(n_steps):
        if run.losses[step] != ref.losses[step]:
            out.append(f"step {step} loss {run.losses[step]!r} != {ref.losses[step]!r}")
        if set(run.grads[step]) != set(ref.grads[step]):
            out.append(f"step {step}: other gradient names")
            continue
        out += [
            f"step {step} gradient of {name}"
            for name, grad in ref.grads[step].items()
            if not torch.equal(run.grads[step][name], grad)
        ]
    if n_steps == len(ref.losses):
        out += [name for name, v in ref.params.items() if not torch.equal(run.params[name], v)]
    return out


def test_every_supported_family_has_a_tiny_model_here() -> None:
    for model_type in SUPPORTED_MODEL_TYPES:
        assert family_config(model_type, 320).model_type == model_type


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("model_type", SUPPORTED_MODEL_TYPES)
def test_pipeline_trains_every_family_bit_for_bit(
    reference: Any, model_type: str, stages: int
) -> None:
    ref = reference(model_type)
    run = _pipeline(ref, model_type, stages)
    assert _differences(run, ref.run) == []
    # The adapter really trained, on the modules and expert weights the job named.
    assert ref.run.losses[1] != ref.run.losses[0]
    names = set(ref.run.params)
    for module in lora_targets(model_type, _targets(model_type)).modules:
        assert any(f".{module}.lora_A." in n for n in names), module
    if family(model_type).moe:
        assert any(".experts.lora_A." in n for n in names)
        assert any(".experts.base_layer.lora_A." in n for n in names)


# peft 0.21.2's PeftModel.from_pretrained calls a transformers 5.23 API deprecated for v6.
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
@pytest.mark.parametrize("model_type", SUPPORTED_MODEL_TYPES)
def test_exported_adapter_loads_on_the_unsplit_model(
    reference: Any, model_type: str, tmp_path: Path
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ref = reference(model_type)
    run = _pipeline(ref, model_type, 3)
    lcfg = _lora(model_type)
    cfg = SimpleNamespace(
        method=SimpleNamespace(
            rank=lcfg["rank"], alpha=lcfg["alpha"], dropout=0.0, target_modules=lcfg["targets"]
        ),
        model=SimpleNamespace(uri=str(ref.model_dir)),
    )
    _export_adapter(cfg, run.stage_params, LocalStore(tmp_path), ref.model_dir)  # type: ignore[arg-type]

    mb = _steps(ref.vocab)[0][0]
    kwargs = {"input_ids": mb.input_ids, "attention_mask": mb.attention_mask,
              "position_ids": mb.position_ids, "use_cache": False}  # fmt: skip

    def unsplit() -> Any:
        model = AutoModelForCausalLM.from_pretrained(
            str(ref.model_dir), config=load_config(ref.model_dir), dtype=torch.float32
        )
        return model.eval()

    with torch.no_grad():
        base = unsplit()
        before = base(**kwargs).logits
        tuned = PeftModel.from_pretrained(base, str(tmp_path)).eval()
        got = tuned(**kwargs).logits
        # The unsplit model carrying the pipeline's LoRA weights, injected as a stage does.
        want_model = unsplit()
        trainable = dict(apply_lora(want_model, lora_config(4, 8.0, 0.0, lcfg["targets"]), 0))
        assert set(trainable) == set(run.params)
        for name, param in trainable.items():
            param.copy_(run.params[name])
        want = want_model(**kwargs).logits
    assert torch.equal(got, want)
    assert not torch.equal(got, before)


# --- each family's twist, taken out of the slices alone ------------------------------------

Breaker = Callable[[pytest.MonkeyPatch, str], None]


def _steps_off(**changes: bool) -> Breaker:
    """The slices skip one of the family's inline forward steps."""

    def apply(mp: pytest.MonkeyPatch, model_type: str) -> None:
        mp.setitem(
            families.FORWARD,
            model_type,
            dataclasses.replace(families.FORWARD[model_type], **changes),
        )

    return apply


def _on_stages(change: Callable[[StageModel], None]) -> Breaker:
    """The slices' modules are changed after they are built (the reference's are not)."""

    def apply(mp: pytest.MonkeyPatch, model_type: str) -> None:
        build = pipelines.build_stage_model

        def broken(*args: Any, **kwargs: Any) -> StageModel:
            stage = build(*args, **kwargs)
            change(stage)
            return stage

        mp.setattr(pipelines, "build_stage_model", broken)

    return apply


def _layers(attribute: str, value: Callable[[nn.Module], Any]) -> Callable[[StageModel], None]:
    """Set `attribute` (a dotted path inside a decoder layer) on every layer of a slice."""

    def change(stage: StageModel) -> None:
        for _, layer in stage.layer_items():
            *path, last = attribute.split(".")
            owner: Any = layer
            for part in path:
                owner = getattr(owner, part, None)
            if owner is not None and hasattr(owner, last):
                setattr(owner, last, value(getattr(owner, last)))

    return change


def _all_full(mp: pytest.MonkeyPatch, model_type: str) -> None:
    """Every layer gets the causal mask (no sliding window)."""
    mp.setattr(families, "layer_type", lambda config, index: families.FULL)


def _one_rotary_base(mp: pytest.MonkeyPatch, model_type: str) -> None:
    """Every layer gets the global layers' rotary embedding."""
    rotary = families.rotary

    def shared(*args: Any) -> dict[str, Any]:
        pairs = rotary(*args)
        return dict.fromkeys(pairs, pairs.get(families.FULL, next(iter(pairs.values()))))

    mp.setattr(families, "rotary", shared)


def _unit_embedding_scale(stage: StageModel) -> None:
    if stage.spec.first:
        stage.inner.embed_tokens.embed_scale.fill_(1.0)


def _full_rotary(stage: StageModel) -> None:
    config = copy.deepcopy(stage.config)
    config.rope_parameters = {**config.rope_parameters, "partial_rotary_factor": 1.0}
    stage.inner.rotary_emb = type(stage.inner.rotary_emb)(config)


def _sdpa(stage: StageModel) -> None:
    stage.model.config._attn_implementation = "sdpa"


def _no_shared_expert(stage: StageModel) -> None:
    for _, layer in stage.layer_items():
        mlp: Any = layer.mlp
        if hasattr(mlp, "shared_expert"):
            mlp.shared_expert_gate.weight.fill_(-1e4)  # sigmoid(gate) == 0: expert switched off


IDENTITY = lambda _: nn.Identity()  # noqa: E731


TWISTS: list[tuple[str, str, Breaker]] = [
    ("mistral", "sliding window on every layer", _steps_off(sliding_when_configured=False)),
    ("qwen2", "sliding layers from max_window_layers", _all_full),
    ("qwen3", "q/k RMSNorm", _on_stages(_layers("self_attn.q_norm", IDENTITY))),
    ("gemma", "scaled embedding", _on_stages(_unit_embedding_scale)),
    ("gemma2", "final logit soft-capping", _steps_off(logit_softcapping=False)),
    ("gemma2", "attention logit soft-capping",
     _on_stages(_layers("self_attn.attn_logit_softcapping", lambda _: None))),
    ("gemma2", "sandwich norms", _on_stages(_layers("post_feedforward_layernorm", IDENTITY))),
    ("gemma2", "alternating sliding layers", _all_full),
    ("gemma3_text", "local and global rotary bases", _one_rotary_base),
    ("gemma3_text", "final logit soft-capping", _steps_off(logit_softcapping=False)),
    ("phi3", "partial rotary", _on_stages(_full_rotary)),
    ("phi3", "sliding window on every layer", _steps_off(sliding_when_configured=False)),
    ("mixtral", "top-2 routing", _on_stages(_layers("mlp.gate.top_k", lambda _: 1))),
    ("mixtral", "sliding window on every layer", _steps_off(sliding_when_configured=False)),
    ("qwen2_moe", "gated shared expert", _on_stages(_no_shared_expert)),
    ("qwen3_moe", "renormalised top-k weights",
     _on_stages(_layers("mlp.gate.norm_topk_prob", lambda _: False))),
    ("gpt_oss", "attention sinks (eager attention)", _on_stages(_sdpa)),
    ("gpt_oss", "alternating sliding layers", _all_full),
    ("olmo2", "post-norms", _on_stages(_layers("post_attention_layernorm", IDENTITY))),
    ("granite", "embedding multiplier", _steps_off(embedding_multiplier=False)),
    ("granite", "logits scaling", _steps_off(logits_scaling=False)),
    ("granite", "residual multiplier", _on_stages(_layers("residual_multiplier", lambda _: 1.0))),
]  # fmt: skip


def test_every_new_family_has_a_negative_check() -> None:
    old = {"llama", "mistral", "qwen2", "qwen3"}
    assert {t for t, _, _ in TWISTS} >= set(SUPPORTED_MODEL_TYPES) - old


@pytest.mark.parametrize(
    ("model_type", "twist", "breaker"), TWISTS, ids=[f"{t}-{w}" for t, w, _ in TWISTS]
)
def test_slices_without_the_twist_fail_the_check(
    reference: Any, monkeypatch: pytest.MonkeyPatch, model_type: str, twist: str, breaker: Breaker
) -> None:
    ref = reference(model_type)  # built before the break: the reference keeps the twist
    breaker(monkeypatch, model_type)
    run = _pipeline(ref, model_type, 2, n_steps=1)
    assert _differences(run, ref.run, n_steps=1) != [], twist


def test_an_unsupported_model_type_is_refused_by_name(tmp_path: Path) -> None:
    import json

    model_dir = tiny_family_dir(tmp_path, "llama")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(ModelLoadError, match=r"model_type 'gpt2' is not supported; supported: "
                       r"llama, mistral, .*gemma3_text, phi3, .*granite"):  # fmt: skip
        load_config(model_dir)


def test_job_target_names_map_onto_each_family() -> None:
    from relaytrain_worker.model.methods import for_family

    default = ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert lora_targets("llama", default).modules == tuple(default)
    phi3 = lora_targets("phi3", ["all-linear"])
    assert phi3.modules == ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    assert lora_targets("phi3", default).modules == ("qkv_proj", "o_proj")
    assert lora_targets("phi3", ["qkv_proj"]).modules == ("qkv_proj",)
    mixtral = lora_targets("mixtral", ["q_proj", "experts.down_proj"])
    assert (mixtral.modules, mixtral.parameters) == (("q_proj",), ("mlp.experts.down_proj",))
    # Only whole path components name an expert weight; dense families have none.
    assert lora_targets("mixtral", ["s.down_proj"]).parameters == ()
    assert lora_targets("llama", ["experts.down_proj"]).modules == ("experts.down_proj",)
    with pytest.raises(ValueError, match="model_type 'phimoe' is not supported"):
        lora_targets("phimoe", default)
    once = for_family(lora_config(4, 8.0, 0.0, [*default, *EXPERTS]), "qwen3_moe")
    twice = for_family(once, "qwen3_moe")
    assert once.target_modules == twice.target_modules == set(default)
    assert once.target_parameters == twice.target_parameters == sorted(f"mlp.{e}" for e in EXPERTS)


def _edit_config(model_dir: Path, **changes: Any) -> None:
    import json

    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, **changes}))


def test_configs_the_slices_would_compute_wrongly_are_refused(tmp_path: Path) -> None:
    model_dir = tiny_family_dir(tmp_path / "gemma", "gemma")
    _edit_config(model_dir, use_bidirectional_attention=True)
    with pytest.raises(ModelLoadError, match=r"use_bidirectional_attention.*not a causal LM"):
        load_config(model_dir)
    quantized = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    _edit_config(model_dir, use_bidirectional_attention=False, quantization_config=quantized)
    with pytest.raises(ModelLoadError, match="pre-quantized"):
        load_config(model_dir)


def test_an_moe_config_asking_for_the_router_loss_is_warned(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model_dir = tiny_family_dir(tmp_path / "mixtral", "mixtral")
    _edit_config(model_dir, output_router_logits=True)
    with caplog.at_level("WARNING", logger="relaytrain.model"):
        load_config(model_dir)
    assert "load-balancing loss is not added" in caplog.text
