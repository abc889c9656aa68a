"""Chat records: the tokenizer's chat template, and exactly the assistant turns learned.

A conversation is rendered once, whole, by the model's own template; each assistant
turn's span in that rendering is then found by rendering again with the turn's content
between two sentinel characters (private-use code points no template or text uses):

- the span starts where the template's generation prompt ends (`<|im_start|>assistant\\n`,
  `<start_of_turn>model\\n`, ...): the last occurrence of that prompt after the rendering of
  the earlier messages, so what a template puts between its prompt and the content (Qwen3's
  empty think block on the final turn) is learned, as the model generates it; a template
  without a generation prompt (Mistral's `[INST]` one) starts at the content;
- the span ends after what the template writes behind the content when the turn closes
  the conversation (`<|im_end|>\\n`, `<|eot_id|>`, `</s>`, ...), as far as the whole
  rendering agrees with it: Phi-3's end-of-text after its last turn is learned there, not
  before the next `<|user|>`.

This holds for templates that render earlier turns differently from the last one (Qwen3
drops think blocks from history, GPT-OSS ends history turns with `<|end|>`), where rendering
prefixes of the conversation and diffing them would put the span on the wrong tokens. The
rendering is tokenized with offsets, and a token is learned when it lies inside a span.
"""

from __future__ import annotations

from typing import Any

from jinja2 import TemplateError

from relaytrain_worker.state.records import IGNORE, DataError

BEGIN = "\ue000"
END = "\ue001"


def _common(a: str, b: str) -> int:
    """Length of the longest common prefix of `a` and `b`."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def assistant_spans(tokenizer: Any, messages: Any, where: str) -> tuple[list[int], list[int]]:
    """(input ids, labels) of a conversation: labels are the ids inside assistant turns
    and -100 elsewhere. DataError naming `where` for a record that is not a conversation,
    one the template refuses, or one with no assistant turn."""
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in messages
    ):
        raise DataError(
            f"dataset.messagesField: the record at {where} is not a list of {{role, content}}"
        )

    def render(msgs: list[dict[str, Any]], prompt: bool = False) -> str:
        try:
            text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=prompt)
        except TemplateError as exc:
            raise DataError(
                f"dataset.messagesField: the chat template refused the record at {where}: {exc}"
            ) from None
        return str(text)

    text = render(messages)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not turns:
        roles = sorted({m["role"] for m in messages})
        raise DataError(
            f"dataset.messagesField: the record at {where} has no assistant message "
            f"(roles: {', '.join(roles) or 'none'}), so nothing in it would be learned"
        )

    spans = [_span(render, messages, i, text, where) for i in turns]
    if not getattr(tokenizer, "is_fast", False):
        raise DataError("dataset.format chat: needs a fast tokenizer (tokenizer.json) for offsets")
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(encoded["input_ids"])
    labels = [IGNORE] * len(ids)
    for t, (start, end) in enumerate(encoded["offset_mapping"]):
        if start < end and any(a <= start and end <= b for a, b in spans):
            labels[t] = ids[t]
    return ids, labels


def _span(
    render: Any, messages: list[dict[str, Any]], i: int, text: str, where: str
) -> tuple[int, int]:
    """[start, end) of assistant message `i` in `text`, the whole conversation's rendering."""
    content = messages[i]["content"]
    if not isinstance(content, str):
        raise DataError(
            f"dataset.messagesField: assistant message {i + 1} of the record at {where} has "
            f"no text content ({type(content).__name__})"
        )
    # A template that trims content (`| trim`) renders the sentinels' whitespace otherwise:
    # the content stripped first renders as it does.
    for body in (content, content.strip()):
        marked = [*messages[:i], {**messages[i], "content": BEGIN + body + END},
                  *messages[i + 1 :]]  # fmt: skip
        rendering = render(marked)
        once = rendering.count(BEGIN) == 1 and rendering.count(END) == 1
        if once and rendering.replace(BEGIN, "").replace(END, "") == text:
            break
    else:
        raise DataError(
            f"dataset.messagesField: the chat template does not render the content of "
            f"assistant message {i + 1} of the record at {where} as it is; cannot find its span"
        )
    a, b = rendering.index(BEGIN), rendering.index(END)
    before = rendering[:a]
    earlier = render(messages[:i])
    prompted = render(messages[:i], prompt=True)
    prompt = prompted[_common(prompted, earlier) :]
    shared = _common(before, earlier)
    found = before.rfind(prompt, shared) if prompt else -1
    start = found + len(prompt) if found >= 0 else a
    closed = render(marked[: i + 1])
    closing = closed[closed.index(END) + 1 :]
    end = b + _common(closing, rendering[b + 1 :])
    # Positions in `text`: BEGIN (before the content) and END are not in it.
    return start, end - 1
