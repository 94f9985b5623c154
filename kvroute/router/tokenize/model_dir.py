"""Reading a Hugging Face model directory: tokenizer, special tokens and chat templates.

Follows how transformers (v5) loads a tokenizer that ships a `tokenizer.json`: the file is the
tokenizer (its post-processor decides what `add_special_tokens` adds; `add_bos_token` in the
config is ignored when the file exists), named special tokens missing from the vocabulary are
added, and chat templates come from `chat_template.jinja` and `additional_chat_templates/*.jinja`
when present, else from `tokenizer_config.json` (one template or a named list).

Caveat: for a few tokenizer classes (e.g. `Qwen2Tokenizer`) transformers rebuilds the pipeline
from the vocabulary instead of using `tokenizer.json` as written; real models ship files that
agree with their class, but a hand-made directory may not. docs/tokenization.md explains how to
check.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer

_NAMED_SPECIAL = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


@dataclass(frozen=True, slots=True)
class ModelFiles:
    tokenizer: Tokenizer
    templates: dict[str, str]  # name -> Jinja source; "default" for the main one
    special_tokens: dict[str, str]  # bos_token -> "<s>", ... (only those that are set)


def _token_content(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a JSON object")
    return data


def load_template_override(value: str) -> str:
    """vLLM's --chat-template: a path to a template file, or the template itself."""
    path = Path(value)
    try:
        if path.is_file():
            return path.read_text(encoding="utf-8")
    except OSError:
        pass
    if any(c in value for c in "{}\n"):
        return value
    raise ValueError(f"chat template file {value!r} does not exist")


def _templates(root: Path, config: dict[str, Any]) -> dict[str, str]:
    templates: dict[str, str] = {}
    main = root / "chat_template.jinja"
    if main.is_file():
        templates["default"] = main.read_text(encoding="utf-8")
    extra = root / "additional_chat_templates"
    if extra.is_dir():
        for f in sorted(extra.glob("*.jinja")):
            templates[f.stem] = f.read_text(encoding="utf-8")
    if templates:
        return templates
    raw = config.get("chat_template")
    if isinstance(raw, str):
        return {"default": raw}
    if isinstance(raw, list):
        for item in raw:
            if isinstance(item, dict) and isinstance(item.get("name"), str):
                templates[item["name"]] = str(item.get("template", ""))
    return templates


def load_model_dir(path: str | Path, template_override: str | None = None) -> ModelFiles:
    """Load a model directory. Raises ValueError / OSError when it is unusable."""
    root = Path(path)
    tok_file = root / "tokenizer.json"
    if not tok_file.is_file():
        raise ValueError(f"{root} has no tokenizer.json")
    tokenizer = Tokenizer.from_file(str(tok_file))
    config = _read_json(root / "tokenizer_config.json")
    legacy_map = _read_json(root / "special_tokens_map.json")
    special: dict[str, str] = {}
    for name in _NAMED_SPECIAL:
        content = _token_content(config.get(name)) if name in config else None
        if content is None and name not in config:
            content = _token_content(legacy_map.get(name))
        if content is not None:
            special[name] = content
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    decoder = config.get("added_tokens_decoder")
    if isinstance(decoder, dict):
        for _, tok in sorted(decoder.items(), key=lambda kv: int(kv[0])):
            content = _token_content(tok)
            if content is not None and content not in vocab:
                tokenizer.add_tokens(
                    [
                        AddedToken(
                            content,
                            special=bool(tok.get("special", True)),
                            normalized=bool(tok.get("normalized", False)),
                            lstrip=bool(tok.get("lstrip", False)),
                            rstrip=bool(tok.get("rstrip", False)),
                            single_word=bool(tok.get("single_word", False)),
                        )
                    ]
                )
    missing = [c for c in special.values() if c not in tokenizer.get_vocab(with_added_tokens=True)]
    if missing:
        tokenizer.add_special_tokens(
            [AddedToken(c, special=True, normalized=False) for c in missing]
        )
    if config.get("split_special_tokens"):
        tokenizer.encode_special_tokens = True
    tokenizer.no_truncation()
    tokenizer.no_padding()
    templates = _templates(root, config)
    if template_override is not None:
        templates = {"default": load_template_override(template_override)}
    return ModelFiles(tokenizer=tokenizer, templates=templates, special_tokens=special)
