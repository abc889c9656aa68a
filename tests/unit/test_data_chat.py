"""Chat data: every family's template learns exactly its assistant turns, and a record that
cannot be rendered fails before training, naming its line and file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from relaytrain_contract import DatasetSpec
from relaytrain_contract.families import SUPPORTED_MODEL_TYPES
from relaytrain_testkit.chat_templates import CHAT_FAMILIES, ChatFamily
from relaytrain_testkit.tiny_models import chat_tokenizer
from relaytrain_worker.state.chat import assistant_spans
from relaytrain_worker.state.data import load_step_data
from relaytrain_worker.state.records import IGNORE, DataError

pytestmark = pytest.mark.unit

SYSTEM = {"role": "system", "content": "you answer in short"}
CONVERSATION = [
    {"role": "user", "content": "what is a stage"},
    {"role": "assistant", "content": "a contiguous slice of the model"},
    {"role": "user", "content": "and the links"},
    {"role": "assistant", "content": "they send activations forward"},
]


def _tokenizer(fam: ChatFamily) -> Any:
    return chat_tokenizer(fam.template, fam.specials, bos=fam.bos, eos=fam.eos)


def _learned_runs(tokenizer: Any, ids: list[int], labels: list[int]) -> list[str]:
    """The decoded runs of consecutive learned tokens (special tokens kept)."""
    runs: list[list[int]] = []
    previous = False
    for token, label in zip(ids, labels, strict=True):
        learned = label != IGNORE
        if learned:
            assert label == token
            if not previous:
                runs.append([])
            runs[-1].append(token)
        previous = learned
    return [tokenizer.decode(run) for run in runs]


def test_every_supported_family_has_a_chat_template_here() -> None:
    assert {name.split("/")[0] for name in CHAT_FAMILIES} == set(SUPPORTED_MODEL_TYPES)


@pytest.mark.parametrize("system", [False, True], ids=["no-system", "system"])
@pytest.mark.parametrize("name", sorted(CHAT_FAMILIES))
def test_the_loss_mask_is_exactly_the_assistant_turns(name: str, system: bool) -> None:
    fam = CHAT_FAMILIES[name]
    if system and not fam.system:
        pytest.skip(f"{name}'s template refuses a system message (tested below)")
    tokenizer = _tokenizer(fam)
    messages = [SYSTEM, *CONVERSATION] if system else CONVERSATION
    ids, labels = assistant_spans(tokenizer, messages, "line 1 of chat.jsonl")
    # The ids are the template's own tokenization of the conversation.
    assert ids == list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False))
    turns = [m["content"] for m in messages if m["role"] == "assistant"]
    want = [fam.learned(content, i == len(turns) - 1) for i, content in enumerate(turns)]
    assert _learned_runs(tokenizer, ids, labels) == want


def test_a_turn_between_turns_keeps_its_own_span() -> None:
    """Qwen3 renders the final turn with an empty think block and earlier ones without: a
    span found by rendering prefixes of the conversation would cover the wrong tokens."""
    fam = CHAT_FAMILIES["qwen3"]
    tokenizer = _tokenizer(fam)
    ids, labels = assistant_spans(tokenizer, CONVERSATION, "here")
    runs = _learned_runs(tokenizer, ids, labels)
    assert runs[0] == "a contiguous slice of the model<|im_end|>\n"
    assert tokenizer.decode(ids).count("<think>") == 1


def _spec(path: Path) -> DatasetSpec:
    return DatasetSpec(uri=str(path), format="chat", textField="text", promptField="prompt",
                       completionField="completion", messagesField="messages",
                       sequenceLength=64, packing=False)  # fmt: skip


def _load(path: Path, tokenizer: Any) -> Any:
    return load_step_data(_spec(path), tokenizer, max_positions=128, micro_batch_size=1,
                          micro_batches=1, seed=0)  # fmt: skip


def _write(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


GOOD = json.dumps({"messages": CONVERSATION[:2]})


def test_a_record_without_messages_is_named_by_line_and_file(tmp_path: Path) -> None:
    tokenizer = _tokenizer(CHAT_FAMILIES["qwen2"])
    # Line 3 (after a blank line) is the second record.
    path = _write(tmp_path, [GOOD, "", json.dumps({"conversation": []})])
    with pytest.raises(DataError, match=rf"field 'messages' .* record 2 \(line 3 of {path}"):
        _load(path, tokenizer)


@pytest.mark.parametrize(
    ("name", "messages", "refusal"),
    [
        ("gemma", [SYSTEM, *CONVERSATION[:2]], "System role not supported"),
        ("mixtral", [SYSTEM, *CONVERSATION[:2]], "Conversation roles must alternate"),
        ("mistral", [CONVERSATION[0], {"role": "tool", "content": "x"}], "Only user and"),
        ("gemma3_text", [CONVERSATION[1], CONVERSATION[0]], "must alternate"),
    ],
)
def test_a_role_the_template_refuses_is_named_by_line_and_file(
    tmp_path: Path, name: str, messages: list[dict[str, str]], refusal: str
) -> None:
    tokenizer = _tokenizer(CHAT_FAMILIES[name])
    path = _write(tmp_path, [GOOD, GOOD, json.dumps({"messages": messages})])
    with pytest.raises(
        DataError, match=rf"chat template refused the record at line 3 of {path}: .*{refusal}"
    ):
        _load(path, tokenizer)


def test_a_tokenizer_without_a_chat_template_is_refused(tmp_path: Path) -> None:
    tokenizer = _tokenizer(CHAT_FAMILIES["qwen2"])
    tokenizer.chat_template = None
    path = _write(tmp_path, [GOOD])
    with pytest.raises(DataError, match=rf"tokenizer has no chat template .*{path}"):
        _load(path, tokenizer)


def test_a_conversation_without_an_assistant_turn_is_refused(tmp_path: Path) -> None:
    tokenizer = _tokenizer(CHAT_FAMILIES["qwen2"])
    sharegpt = [{"role": "human", "content": "hi"}, {"role": "gpt", "content": "hello"}]
    path = _write(tmp_path, [GOOD, json.dumps({"messages": sharegpt})])
    with pytest.raises(DataError, match=r"line 2 of .* no assistant message \(roles: gpt, human"):
        _load(path, tokenizer)
