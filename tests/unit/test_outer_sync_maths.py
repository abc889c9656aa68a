"""The maths of a cheaper periodic outer step (replicas/outer_codec.py, lora_merge.py).

The low-bit code of an update loses nothing for good: what it leaves out is the residual, exactly,
and error feedback sends it later; every pipeline decodes the same bytes to the same mean.
The exact LoRA merge leaves every replica's layer equal to the token-weighted mean of the
pipelines' layers, where averaging the factors one by one is measurably off.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from relaytrain_testkit.tiny_models import tiny_model_dir
from relaytrain_worker.model import lora_merge
from relaytrain_worker.model.methods import apply_lora, lora_config
from relaytrain_worker.replicas import outer_codec

pytestmark = pytest.mark.unit


def _update(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen) * torch.rand(n, generator=gen)


@pytest.mark.parametrize(("n", "bits"), [(1000, 2), (64, 4), (3, 1), (4097, 2)])
def test_code_plus_residual_is_the_update(n: int, bits: int) -> None:
    update = _update(n, n)
    code, residual = outer_codec.encode(update, 17.0, bits)
    weight, sent = outer_codec.decode(code, n, bits)
    assert weight == 17.0
    assert code.numel() == outer_codec.code_bytes(n, bits)
    assert torch.allclose(sent + residual, update, rtol=0, atol=1e-6)
    # The code carries most of the update: the rotated Lloyd-Max error at that many bits.
    bound = {1: 0.7, 2: 0.45, 4: 0.15}[bits]
    assert residual.norm() <= bound * update.norm()


def test_the_code_is_deterministic_and_refuses_a_diverging_update() -> None:
    update = _update(5000, 1)
    assert torch.equal(outer_codec.encode(update, 1.0, 2)[0], outer_codec.encode(update, 1.0, 2)[0])
    update[7] = float("nan")
    with pytest.raises(ValueError, match="NaN or infinite"):
        outer_codec.encode(update, 1.0, 2)
    with pytest.raises(ValueError, match="is not one of 10 values"):
        outer_codec.decode(torch.zeros(5, dtype=torch.uint8), 10, 2)
    with pytest.raises(ValueError, match="valid: int4, int2, int1"):
        outer_codec.bits_of("float64")


@pytest.mark.parametrize("bits", [1, 2])
def test_error_feedback_delivers_a_constant_update_in_full_over_rounds(bits: int) -> None:
    # Every round a pipeline adds the same local progress d; what it has sent in total
    # after k rounds differs from k * d only by the current residual, which stays bounded
    # (below 1.5 d at 1 bit, 0.5 d at 2, each round coded in a fresh rotation): nothing is
    # dropped, only delayed. Without feedback the error of every round would add up.
    d = _update(2048, 3)
    residual = torch.zeros_like(d)
    sent_total = torch.zeros_like(d)
    for k in range(1, 65):
        code, residual = outer_codec.encode(d + residual, 1.0, bits, variant=k)
        sent_total += outer_codec.decode(code, d.numel(), bits, variant=k)[1]
        assert torch.allclose(sent_total + residual, k * d, rtol=0, atol=1e-4 * k)
        assert residual.norm() < (1.5 if bits == 1 else 0.5) * d.norm()
    # The decoder must use the encoder's rotation.
    assert not torch.equal(outer_codec.decode(code, d.numel(), bits, variant=1)[1], d - residual)
    plain = outer_codec.decode(outer_codec.encode(d, 1.0, bits)[0], d.numel(), bits)[1]
    assert (64 * (d - plain)).norm() > 10 * residual.norm()


def test_every_pipeline_decodes_the_same_token_weighted_mean() -> None:
    weights = [30, 10, 0, 20]
    codes = [outer_codec.encode(_update(700, q), w, 2)[0] for q, w in enumerate(weights)]
    mean = outer_codec.weighted_mean(codes, 700, 2)
    expected = sum(
        w * outer_codec.decode(c, 700, 2)[1].double() for c, w in zip(codes, weights, strict=True)
    )
    assert torch.equal(mean, (expected / 60).float())
    assert torch.equal(outer_codec.weighted_mean(torch.stack(codes), 700, 2), mean)
    assert not outer_codec.weighted_mean([codes[2]], 700, 2).any()  # nobody trained


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> list[torch.nn.Module]:
    """Three pipelines' copies of a LoRA model whose adapters drifted apart."""
    from transformers import AutoModelForCausalLM

    path = tiny_model_dir(tmp_path_factory.mktemp("llama"), layers=2)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    apply_lora(model, lora_config(4, 8.0, 0.0, ["q_proj", "v_proj"]), seed=1)
    out = []
    for q in range(3):
        copy_ = copy.deepcopy(model)
        gen = torch.Generator().manual_seed(10 + q)
        with torch.no_grad():
            for name, param in copy_.named_parameters():
                if ".lora_" in name:
                    param.add_(torch.randn(param.shape, generator=gen) * 0.3)
        out.append(copy_)
    return out


def _merge(models: list[torch.nn.Module], weights: list[float], exact: bool) -> None:
    layers = [lora_merge.lora_layers(m) for m in models]
    for name in layers[0]:
        factors = [
            (w, *(p.detach() for p in lora_merge.layer_factors(ls[name])))
            for w, ls in zip(weights, layers, strict=True)
        ]
        b, a, fold = lora_merge.exact_merge(factors)
        for ls in layers:
            b_param, a_param = lora_merge.layer_factors(ls[name])
            with torch.no_grad():
                b_param.copy_(b)
                a_param.copy_(a)
            if exact:
                lora_merge.fold_into(ls[name], fold)


@pytest.mark.parametrize("exact", [True, False])
def test_the_exact_merge_is_the_mean_of_the_layers_and_the_naive_one_is_not(
    replicas: list[torch.nn.Module], exact: bool
) -> None:
    weights = [5.0, 3.0, 2.0]
    models = [copy.deepcopy(m) for m in replicas]
    before = [lora_merge.lora_layers(m) for m in models]
    names = list(before[0])
    assert names
    want = {
        n: sum(
            w * lora_merge.effective_weight(ls[n]) for w, ls in zip(weights, before, strict=True)
        )
        / sum(weights)
        for n in names
    }
    _merge(models, weights, exact)
    for model in models:
        layers = lora_merge.lora_layers(model)
        for n in names:
            error = (lora_merge.effective_weight(layers[n]) - want[n]).abs().max()
            scale = want[n].abs().max()
            if exact:
                assert error <= 1e-6 * scale, n
            else:
                assert error > 1e-3 * scale, n  # the aggregation bias


def test_equal_adapters_merge_to_themselves_with_nothing_folded(
    replicas: list[torch.nn.Module],
) -> None:
    layer = next(iter(lora_merge.lora_layers(replicas[0]).values()))
    b, a = (p.detach() for p in lora_merge.layer_factors(layer))
    mean_b, mean_a, fold = lora_merge.exact_merge([(2.0, b, a), (7.0, b, a)])
    assert torch.allclose(mean_b, b, atol=1e-7) and torch.allclose(mean_a, a, atol=1e-7)
    assert fold.abs().max() <= 1e-6 * (b @ a).abs().max()
    with pytest.raises(ValueError, match="positive weight"):
        lora_merge.exact_merge([(0.0, b, a)])


def test_a_fan_in_fan_out_layer_folds_transposed(tmp_path: Path) -> None:
    from peft import LoraConfig, inject_adapter_in_model
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64))
    config = LoraConfig(r=2, lora_alpha=4, target_modules=["c_attn"], fan_in_fan_out=True)
    inject_adapter_in_model(config, model)
    (layer,) = lora_merge.lora_layers(model).values()
    b, a = lora_merge.layer_factors(layer)
    with torch.no_grad():
        b.normal_()
    before = lora_merge.effective_weight(layer)
    fold = torch.randn(b.shape[0], a.shape[1])
    lora_merge.fold_into(layer, fold)
    scaling = float(layer.scaling["default"])
    assert torch.allclose(
        lora_merge.effective_weight(layer) - before, fold.T.double() * scaling, atol=1e-5
    )
