"""The chat templates of the supported families, as test data (no hub at test time).

Each is the part of the family's published instruct template (tokenizer_config.json's
`chat_template`) that a text conversation goes through — system, user and assistant turns,
the generation prompt — written out here; tool-calling branches are left out. Per family:
the template, its special tokens (each one token in the test tokenizer), bos and eos, and
what an assistant turn must learn: the text from the end of the generation prompt through
the template's end-of-turn marker, for a turn that is and one that is not the last.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class ChatFamily:
    template: str
    specials: tuple[str, ...]
    bos: str
    eos: str
    learned: Callable[[str, bool], str]
    """(content, is the last message) -> the text the assistant turn learns."""
    system: bool = True
    """Whether the template takes a system message."""


CHATML_QWEN2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)

MISTRAL_V01 = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}"
    "{% endfor %}"
)

QWEN3 = """\
{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""  # noqa: E501 - the template's own lines

GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if (message['role'] == 'assistant') %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)

GEMMA3 = """\
{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {{- message['content'] | trim -}}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""

PHI3 = (
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{'<|system|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'assistant' %}"
    "{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)

PHI4 = (
    "{% for message in messages %}{% if (message['role'] == 'system') %}"
    "{{'<|im_start|>system<|im_sep|>' + message['content'] + '<|im_end|>'}}"
    "{% elif (message['role'] == 'user') %}"
    "{{'<|im_start|>user<|im_sep|>' + message['content'] + '<|im_end|>'}}"
    "{% elif (message['role'] == 'assistant') %}"
    "{{'<|im_start|>assistant<|im_sep|>' + message['content'] + '<|im_end|>'}}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant<|im_sep|>' }}{% endif %}"
)

GPT_OSS = """\
{{- "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\\n" }}
{{- "Knowledge cutoff: 2024-06\\n\\nReasoning: medium\\n\\n" }}
{{- "# Valid channels: analysis, commentary, final. Channel must be included for every message." }}
{{- "<|end|>" }}
{%- if messages[0].role == "developer" or messages[0].role == "system" %}
    {%- set developer_message = messages[0].content %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set developer_message = "" %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if developer_message %}
    {{- "<|start|>developer<|message|># Instructions\\n\\n" + developer_message + "\\n\\n<|end|>" }}
{%- endif %}
{%- for message in loop_messages -%}
    {%- if message.role == 'assistant' -%}
        {%- if "<|channel|>" in message.content %}
            {{- raise_exception("You have passed a message containing <|channel|> tags in the content field.") }}
        {%- endif %}
        {%- if loop.last and not add_generation_prompt %}
            {%- if "thinking" in message %}
                {{- "<|start|>assistant<|channel|>analysis<|message|>" + message.thinking + "<|end|>" }}
            {%- endif %}
            {{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|return|>" }}
        {%- else %}
            {{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|end|>" }}
        {%- endif %}
    {%- elif message.role == 'user' -%}
        {{- "<|start|>user<|message|>" + message.content + "<|end|>" }}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|start|>assistant
{%- endif -%}
"""  # noqa: E501 - the template's own lines

OLMO2 = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{ '<|system|>\n' + message['content'] + '\n' }}{% elif message['role'] == 'user' %}"
    "{{ '<|user|>\n' + message['content'] + '\n' }}{% elif message['role'] == 'assistant' %}"
    "{% if not loop.last %}{{ '<|assistant|>\n'  + message['content'] + eos_token + '\n' }}"
    "{% else %}{{ '<|assistant|>\n'  + message['content'] + eos_token }}{% endif %}{% endif %}"
    "{% if loop.last and add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
    "{% endfor %}"
)

GRANITE = """\
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set system_message = "Knowledge Cutoff Date: April 2024.\\nYou are Granite, developed by IBM. You are a helpful AI assistant." %}
    {%- set loop_messages = messages %}
{%- endif %}
{{- '<|start_of_role|>system<|end_of_role|>' + system_message + '<|end_of_text|>\\n' }}
{%- for message in loop_messages %}
    {{- '<|start_of_role|>' + message['role'] + '<|end_of_role|>' + message['content'] + '<|end_of_text|>\\n' }}
    {%- if loop.last and add_generation_prompt %}
        {{- '<|start_of_role|>assistant<|end_of_role|>' }}
    {%- endif %}
{%- endfor %}
"""  # noqa: E501 - the template's own lines

_CHATML = ("<|im_start|>", "<|im_end|>")
_GEMMA = ("<start_of_turn>", "<end_of_turn>")


def _chatml(content: str, last: bool) -> str:
    return content + "<|im_end|>\n"


def _qwen3(content: str, last: bool) -> str:
    return ("<think>\n\n</think>\n\n" if last else "") + content + "<|im_end|>\n"


def _gemma(content: str, last: bool) -> str:
    return content.strip() + "<end_of_turn>\n"


_QWEN2 = ChatFamily(CHATML_QWEN2, _CHATML, "<|endoftext|>", "<|im_end|>", _chatml)
_QWEN3 = ChatFamily(QWEN3, _CHATML, "<|endoftext|>", "<|im_end|>", _qwen3)
_GEMMA_IT = ChatFamily(GEMMA, _GEMMA, "<bos>", "<eos>", _gemma, system=False)
_MISTRAL = ChatFamily(MISTRAL_V01, (), "<s>", "</s>", lambda c, last: c + "</s>", system=False)

#: Per supported model_type (and a second template where a family has two in use).
CHAT_FAMILIES: dict[str, ChatFamily] = {
    "llama": ChatFamily(
        LLAMA3,
        ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
        "<|begin_of_text|>",
        "<|eot_id|>",
        lambda c, last: c.strip() + "<|eot_id|>",
    ),
    "llama/smollm2": ChatFamily(SMOLLM2, _CHATML, "<|im_start|>", "<|im_end|>", _chatml),
    "mistral": _MISTRAL,
    "qwen2": _QWEN2,
    "qwen3": _QWEN3,
    "gemma": _GEMMA_IT,
    "gemma2": _GEMMA_IT,
    "gemma3_text": ChatFamily(GEMMA3, _GEMMA, "<bos>", "<eos>", _gemma),
    "phi3": ChatFamily(
        PHI3,
        ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>"),
        "<s>",
        "<|endoftext|>",
        lambda c, last: c + "<|end|>\n" + ("<|endoftext|>" if last else ""),
    ),
    "phi3/phi4": ChatFamily(
        PHI4,
        (*_CHATML, "<|im_sep|>"),
        "<|endoftext|>",
        "<|im_end|>",
        lambda c, last: c + "<|im_end|>",
    ),
    "mixtral": _MISTRAL,
    "qwen2_moe": _QWEN2,
    "qwen3_moe": _QWEN3,
    "gpt_oss": ChatFamily(
        GPT_OSS,
        ("<|start|>", "<|message|>", "<|channel|>", "<|end|>", "<|return|>"),
        "<|startoftext|>",
        "<|return|>",
        # History turns end with <|end|>, which the model never emits after a final message.
        lambda c, last: "<|channel|>final<|message|>" + c + ("<|return|>" if last else ""),
    ),
    "olmo2": ChatFamily(
        OLMO2,
        ("<|system|>", "<|user|>", "<|assistant|>"),
        "<|endoftext|>",
        "<|endoftext|>",
        lambda c, last: c + "<|endoftext|>",
    ),
    "granite": ChatFamily(
        GRANITE,
        ("<|start_of_role|>", "<|end_of_role|>"),
        "<|end_of_text|>",
        "<|end_of_text|>",
        lambda c, last: c + "<|end_of_text|>\n",
    ),
}
