"""Small but real Hugging Face model directories for the tokenize tests.

Each directory holds a `tokenizer.json` trained in memory with the `tokenizers` library (a
tiny BPE), a `tokenizer_config.json` with special tokens and a Jinja chat template written for
these tests in the style of real models:

- "chatml": byte-level BPE with a Llama-3-like split regex, ChatML markers, tools, reasoning,
  tool responses; string content format.
- "llama3": the same tokenizer, a Llama-3-like template that starts with `bos_token`, iterates
  over content parts (OpenAI content format), renders documents and tools.
- "metaspace": a SentencePiece-like BPE (Metaspace pre-tokenizer, prepend scheme "first") whose
  post-processor adds `<s>`, with a Llama-2-like `[INST]` template that writes `<s>` per turn.

The templates are original to kvroute; they only imitate the shapes real templates have.
"""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    processors,
    trainers,
)

CORPUS = [
    "The router sends each request to the worker that already holds its prefix.",
    "A cache-aware router counts the prefill that a worker's cache saves.",
    "You are a helpful assistant. Answer briefly and precisely.",
    "What is the weather in Paris today? It is sunny, 23 degrees.",
    "Call get_weather with the city name and the unit, celsius or fahrenheit.",
    'The function returned {"temperature": 23, "unit": "celsius"} for Paris.',
    "Tokens, blocks, hashes: the index keys blocks by their content.",
    "Sliding window groups and Mamba state make hybrid models special.",
    "Numbers like 12345 and 3.14159 and dates like 2024-07-26 appear too.",
    "Emojis and accents: café, naïve, Zürich, 東京, 😀 should survive byte-level BPE.",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n",
    "user assistant system tool tools function arguments name content reasoning think",
    "Documents: title text source. Summarize the following document in one sentence.",
    "  leading spaces,\ttabs,\n\nblank lines and trailing spaces   ",
]

LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CHATML_SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
]
# Added but not special: written by templates, never stripped by decoders (like Qwen's).
CHATML_PLAIN_ADDED = ["<tool_call>", "</tool_call>", "<think>", "</think>"]

CHATML_TEMPLATE = """\
{%- if messages and messages[0].role == 'system' -%}
  {%- set sys_text = messages[0].content -%}
  {%- set rest = messages[1:] -%}
{%- else -%}
  {%- set sys_text = '' -%}
  {%- set rest = messages -%}
{%- endif -%}
{%- if tools -%}
<|im_start|>system
{{ sys_text if sys_text else 'You are a helpful assistant.' }}

# Tools

You may call functions. Their signatures:
<tools>
{% for tool in tools -%}
{{ tool | tojson }}
{% endfor -%}
</tools>
Put each call inside <tool_call></tool_call> tags.<|im_end|>
{% elif sys_text -%}
<|im_start|>system
{{ sys_text }}<|im_end|>
{% endif -%}
{%- for m in rest -%}
  {%- if m.role == 'user' or m.role == 'system' -%}
<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% elif m.role == 'assistant' -%}
<|im_start|>assistant
{% if m.reasoning_content is defined and m.reasoning_content -%}
<think>
{{ m.reasoning_content }}
</think>

{% endif -%}
{{ m.content if m.content is string else '' }}
{%- for tc in m.tool_calls if m.tool_calls is defined %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif m.role == 'tool' -%}
<|im_start|>tool
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else -%}
{{ raise_exception('This model does not accept the role ' + m.role) }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking -%}
<think>

</think>

{% endif -%}
{%- endif -%}
"""

LLAMA3_TEMPLATE = """\
{{- bos_token }}
{%- if messages[0].role == 'system' %}
  {%- if messages[0].content is string %}
    {%- set system_message = messages[0].content | trim %}
  {%- else %}
    {%- set system_message = messages[0].content[0].text | trim %}
  {%- endif %}
  {%- set messages = messages[1:] %}
{%- else %}
  {%- set system_message = '' %}
{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
{%- if tools is not none %}
  {{- 'Environment: ipython\\nYou can call these functions:\\n' }}
  {%- for t in tools %}
    {{- t | tojson(indent=2) }}
    {{- '\\n' }}
  {%- endfor %}
{%- endif %}
{%- if documents %}
  {{- 'Documents:\\n' }}
  {%- for d in documents %}
    {{- '[' ~ loop.index ~ '] ' ~ d.title ~ ': ' ~ d.text ~ '\\n' }}
  {%- endfor %}
{%- endif %}
{{- system_message }}
{{- '<|eot_id|>' }}
{%- for message in messages %}
  {%- if message.role == 'tool' %}
    {{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' }}
    {%- if message.content is mapping
          or message.content is iterable and message.content is not string %}
      {{- message.content | tojson }}
    {%- else %}
      {{- message.content }}
    {%- endif %}
    {{- '<|eot_id|>' }}
  {%- elif message.role == 'assistant' and message.tool_calls is defined %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
    {%- for call in message.tool_calls %}
      {{- '<|python_tag|>{"name": "' + call.function.name + '", "parameters": ' }}
      {{- call.function.arguments | tojson }}
      {{- '}' }}
    {%- endfor %}
    {{- '<|eot_id|>' }}
  {%- else %}
    {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' }}
    {%- if message.content is string %}
      {{- message.content | trim }}
    {%- else %}
      {%- for part in message.content %}
        {%- if part.type == 'text' %}
          {{- part.text | trim }}
        {%- endif %}
      {%- endfor %}
    {%- endif %}
    {{- '<|eot_id|>' }}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
  {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

METASPACE_TEMPLATE = """\
{%- for m in messages -%}
{%- if m.role == 'system' -%}
<<SYS>>
{{ m.content }}
<</SYS>>

{% elif m.role == 'user' -%}
{{ bos_token }}[INST] {{ m.content | trim }} [/INST]
{%- elif m.role == 'assistant' -%}
{{ ' ' + m.content | trim + ' ' + eos_token }}
{%- else -%}
{{ raise_exception('roles are system, user and assistant') }}
{%- endif -%}
{%- endfor -%}
"""


def _byte_level_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        min_frequency=1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 3, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CHATML_SPECIALS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in CHATML_PLAIN_ADDED])
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def _metaspace_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    alphabet = sorted({c for line in CORPUS for c in line} | set(string.printable.strip()) | {"▁"})
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        min_frequency=1,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 3, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ["<s>", "</s>"]])
    bos_id = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
    )
    return tok


def build_model_dir(path: Path, kind: str = "chatml") -> Path:
    """Write a model directory of the given kind into `path` (created) and return it."""
    path.mkdir(parents=True, exist_ok=True)
    config: dict[str, Any]
    if kind in ("chatml", "llama3"):
        tok = _byte_level_tokenizer()
        if kind == "chatml":
            config = {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "chat_template": CHATML_TEMPLATE,
                "model_max_length": 32768,
            }
        else:
            config = {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|begin_of_text|>",
                "eos_token": "<|eot_id|>",
                "chat_template": LLAMA3_TEMPLATE,
                "model_max_length": 32768,
            }
        hf_config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    elif kind == "metaspace":
        tok = _metaspace_tokenizer()
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
            "chat_template": METASPACE_TEMPLATE,
            "model_max_length": 4096,
        }
        hf_config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    else:
        raise ValueError(f"unknown fixture kind {kind!r}")
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    # Enough of a model config for vLLM's render pipeline (no weights are ever loaded).
    vocab = tok.get_vocab_size(with_added_tokens=True)
    hf_config.update(
        {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "num_hidden_layers": 2,
            "max_position_embeddings": int(config["model_max_length"]),
            "vocab_size": vocab,
            "rms_norm_eps": 1e-5,
            "torch_dtype": "float32",
        }
    )
    (path / "config.json").write_text(json.dumps(hf_config, indent=2))
    return path


if __name__ == "__main__":
    import sys

    for kind in ("chatml", "llama3", "metaspace"):
        print(build_model_dir(Path(sys.argv[1]) / kind, kind))
