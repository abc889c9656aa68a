"""Tiny models from configs, for tests and benchmarks: random weights (no hub downloads),
saved as real sharded safetensors checkpoints with a small byte-level BPE tokenizer trained
on the spot, so every code path a real model takes (index, shards, tokenizer, chat
template) is exercised.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""The chat template every tiny tokenizer carries (ChatML)."""

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a stage is a contiguous slice of the model",
    "pipelines send activations forward and gradients back",
    "low rank adapters train few parameters",
    "checkpoints are committed by a manifest written last",
]
"""What every tiny tokenizer is trained on (and what small data sets are made of)."""


def save_tokenizer(out: Path, vocab_size: int = 320) -> int:
    """Train a byte-level BPE on CORPUS and save it; returns the tokenizer's size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<pad>",
        chat_template=CHAT_TEMPLATE,
    )
    fast.save_pretrained(str(out))
    return len(fast)


def chat_tokenizer(chat_template: str, specials: Sequence[str], *, bos: str, eos: str) -> Any:
    """A byte-level BPE trained on CORPUS whose special tokens are `specials` (a family's
    turn markers, each one token), with `chat_template` (a family's template: chat_templates)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    names = list(dict.fromkeys([bos, eos, *specials, "<pad>"]))
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=names,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=eos,
        pad_token="<pad>",
        additional_special_tokens=[n for n in names if n not in (bos, eos, "<pad>")],
        chat_template=chat_template,
    )


def tiny_model_dir(
    out: Path,
    *,
    arch: Literal["llama", "mistral", "qwen2"] = "llama",
    layers: int = 4,
    hidden: int = 32,
    tied: bool = True,
    max_shard_size: str = "40KB",
    max_positions: int = 128,
    seed: int = 0,
    intermediate: int | None = None,
    vocab: int | None = None,
) -> Path:
    """A random tiny causal LM saved like a hub checkpoint (sharded) with a tokenizer."""
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

    out.mkdir(parents=True, exist_ok=True)
    n_tok = save_tokenizer(out)
    kinds: dict[str, Any] = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}
    config = kinds[arch](
        vocab_size=vocab or n_tok,
        hidden_size=hidden,
        intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tied,
        pad_token_id=n_tok - 1,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    model.save_pretrained(str(out), max_shard_size=max_shard_size)
    return out
