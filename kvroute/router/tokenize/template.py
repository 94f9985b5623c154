"""Chat templates rendered the way transformers' `apply_chat_template` renders them.

The environment matches what Hugging Face chat templates are written against: a sandboxed
(immutable) Jinja environment with `trim_blocks` and `lstrip_blocks`, loop controls, the
`{% generation %}` tag, the `tojson` filter without HTML escaping, and the globals
`raise_exception`, `strftime_now`, `dict` and a `namespace` that refuses underscore names.

`ChatTemplate.render` applies transformers' conventions around the template: message keys whose
value is None are dropped, a message's reasoning is also offered as `thinking` and
`reasoning_content`, `continue_final_message` leaves the final message open, and the named
special tokens (`bos_token`, `eos_token`, ...) are visible unless a keyword overrides them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.parser
import jinja2.sandbox
import jinja2.utils

from kvroute.router.tokenize.errors import TokenizeError

ContentFormat = Literal["string", "openai"]

# Names under which a message's reasoning reaches the template; the first is the common one.
_REASONING_NAMES = ("reasoning_content", "thinking", "reasoning")
# Marks the end of the final message for continue_final_message (then cut off again).
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text; rendering keeps the body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_keep_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _keep_body(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _DictFactory:
    """`dict(...)` inside templates, without exposing the type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses attributes starting with an underscore."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"a chat template cannot set the attribute {name!r} on a namespace"
            )


def make_environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    """A fresh Jinja environment configured like transformers' chat template environment."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _DictFactory()
    env.globals["namespace"] = _Namespace
    return env


@dataclass(frozen=True, slots=True)
class RenderInput:
    """Everything a template render depends on, already validated."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    documents: list[dict[str, Any]] | None
    add_generation_prompt: bool
    continue_final_message: bool
    # Extra keywords for the template (chat_template_kwargs, reasoning_effort, ...); only the
    # names the template uses are passed, as vLLM does.
    kwargs: Mapping[str, Any]


class ChatTemplate:
    """One compiled chat template and what can be known about it statically."""

    def __init__(self, source: str, env: jinja2.sandbox.ImmutableSandboxedEnvironment) -> None:
        self.source = source
        try:
            ast = env.parse(source)
            self._compiled = env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"chat template does not compile: {exc}") from exc
        self.variables: frozenset[str] = frozenset(jinja2.meta.find_undeclared_variables(ast))
        self.content_format: ContentFormat = detect_content_format(ast)
        # vLLM turns `developer` messages into `system` ones unless the template names the role.
        self.knows_developer_role = '"developer"' in source or "'developer'" in source

    def render(self, inp: RenderInput, special_tokens: Mapping[str, str]) -> str:
        """The prompt text, as transformers renders it with `tokenize=False`.

        Raises TokenizeError when the template or its conventions reject the input.
        """
        messages = [
            _alias_reasoning({k: v for k, v in m.items() if v is not None}) for m in inp.messages
        ]
        if not messages:
            raise TokenizeError("messages must not be empty", param="messages")
        for reserved in ("messages", "conversation"):
            if reserved in inp.kwargs:
                raise TokenizeError(
                    f"chat_template_kwargs cannot set {reserved!r}", param="chat_template_kwargs"
                )
        context: dict[str, Any] = dict(special_tokens)
        context.update(inp.kwargs)
        final_text: str | None = None
        if inp.continue_final_message:
            final_text = _tag_final_message(messages, self.source)
        try:
            rendered = self._compiled.render(
                messages=messages,
                tools=inp.tools,
                documents=inp.documents,
                add_generation_prompt=inp.add_generation_prompt,
                **context,
            )
        except jinja2.TemplateError as exc:
            raise TokenizeError(f"chat template rejected the request: {exc}") from exc
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError) as exc:
            raise TokenizeError(f"chat template failed on the request: {exc}") from exc
        if final_text is not None:
            rendered = _cut_at_tag(rendered, final_text)
        return rendered


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    reasoning = next((message[k] for k in _REASONING_NAMES if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _tag_final_message(messages: list[dict[str, Any]], source: str) -> str:
    """Append the continuation tag to the final message's text; return the original text."""
    last = messages[-1]
    final = last.get("content")
    if final is None:
        raise TokenizeError(
            "continue_final_message is set but the final message has no content",
            param="continue_final_message",
        )
    if "content" not in source:
        raise TokenizeError(
            "continue_final_message is set but this chat template does not use message content",
            param="continue_final_message",
        )
    if isinstance(final, (list, tuple)):
        parts = [dict(p) if isinstance(p, dict) else p for p in final]
        for part in reversed(parts):
            if isinstance(part, dict) and "text" in part:
                text = str(part["text"])
                part["text"] = text + _CONTINUE_TAG
                last["content"] = parts
                return text
        raise TokenizeError(
            "continue_final_message is set but the final message has no text to continue",
            param="continue_final_message",
        )
    if not isinstance(final, str):
        raise TokenizeError(
            "continue_final_message needs text content", param="continue_final_message"
        )
    last["content"] = final + _CONTINUE_TAG
    return final


def _cut_at_tag(rendered: str, final_text: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final_text.strip() not in rendered or tag not in rendered:
        raise TokenizeError(
            "continue_final_message is set but the chat template drops part of the final message",
            param="continue_final_message",
        )
    at = rendered.rindex(tag)
    if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    # The template trimmed the space after the tag, so trailing whitespace is not ours to keep.
    return rendered[:at].rstrip()


# ---- content format detection ------------------------------------------------------------
#
# A template "iterates over content" (OpenAI format: content is a list of typed parts) when it
# has a for-loop over the `content` of a message it got from `messages`; otherwise it expects
# content as one string. Names that alias `messages` (`set msgs = messages[1:]`,
# `ns.rest = messages`) and macros that receive a message's content are followed.


def _unwrap(node: jinja2.nodes.Node) -> jinja2.nodes.Node:
    """Strip filters, tests and slicing: `x | reverse`, `x is defined`, `x[1:]` all mean `x`."""
    while True:
        inner: jinja2.nodes.Node | None = None
        if isinstance(node, (jinja2.nodes.Filter, jinja2.nodes.Test)) or (
            isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice)
        ):
            inner = node.node
        if inner is None:
            return node
        node = inner


def _dotted(node: jinja2.nodes.Node) -> str | None:
    if isinstance(node, jinja2.nodes.Name):
        return node.name
    if isinstance(node, jinja2.nodes.NSRef):
        return f"{node.name}.{node.attr}"
    if isinstance(node, jinja2.nodes.Getattr):
        base = _dotted(node.node)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _refers_to(node: jinja2.nodes.Node, names: set[str]) -> bool:
    name = _dotted(_unwrap(node))
    return name is not None and name in names


def _field_of(node: jinja2.nodes.Node, names: set[str], field: str) -> bool:
    """`node` is `<name>.field` or `<name>['field']` for one of `names` (after unwrapping)."""
    node = _unwrap(node)
    if isinstance(node, jinja2.nodes.Getattr) and node.attr == field:
        return _refers_to(node.node, names)
    if (
        isinstance(node, jinja2.nodes.Getitem)
        and isinstance(node.arg, jinja2.nodes.Const)
        and node.arg.value == field
    ):
        return _refers_to(node.node, names)
    return False


def _assignments(ast: jinja2.nodes.Template) -> Iterator[tuple[str, jinja2.nodes.Node]]:
    """(target name, value) for every `set`, including namespace keywords `namespace(a=x)`."""
    for assign in ast.find_all(jinja2.nodes.Assign):
        target = _dotted(assign.target)
        if target is not None:
            yield target, assign.node
        value = assign.node
        if (
            isinstance(assign.target, jinja2.nodes.Name)
            and isinstance(value, jinja2.nodes.Call)
            and isinstance(value.node, jinja2.nodes.Name)
            and value.node.name == "namespace"
        ):
            for kw in value.kwargs:
                yield f"{assign.target.name}.{kw.key}", kw.value


def detect_content_format(ast: jinja2.nodes.Template) -> ContentFormat:
    """ "openai" if the template loops over a message's content parts, else "string"."""
    assigns = list(_assignments(ast))
    sequences = {"messages"}
    changed = True
    while changed:
        changed = False
        for target, value in assigns:
            if target not in sequences and _refers_to(value, sequences):
                sequences.add(target)
                changed = True
    loops = list(ast.find_all(jinja2.nodes.For))
    items: set[str] = set()
    for loop in loops:
        if _refers_to(loop.iter, sequences) and isinstance(loop.target, jinja2.nodes.Name):
            items.add(loop.target.name)
    macro_loops: set[int] = set()
    for macro in ast.find_all(jinja2.nodes.Macro):
        params = [a.name for a in macro.args]
        receives: set[str] = set()
        for call in ast.find_all(jinja2.nodes.Call):
            if not (isinstance(call.node, jinja2.nodes.Name) and call.node.name == macro.name):
                continue
            for i, arg in enumerate(call.args):
                if i < len(params) and _field_of(arg, items, "content"):
                    receives.add(params[i])
            for kw in call.kwargs:
                if kw.key in params and _field_of(kw.value, items, "content"):
                    receives.add(kw.key)
        for loop in macro.find_all(jinja2.nodes.For):
            macro_loops.add(id(loop))
            if isinstance(loop.iter, jinja2.nodes.Name) and loop.iter.name in receives:
                return "openai"
    for loop in loops:
        if _field_of(loop.iter, items, "content"):
            return "openai"
        # A loop over a variable literally named `content` counts too (vLLM's rule).
        if (
            id(loop) not in macro_loops
            and isinstance(loop.iter, jinja2.nodes.Name)
            and loop.iter.name == "content"
        ):
            return "openai"
    return "string"


def choose_template(
    templates: Mapping[str, str], requested: str | None, has_tools: bool
) -> str | None:
    """Pick the template source like transformers: a named one, `tool_use` when tools are
    given, else `default`; a single unnamed template is stored as `default`."""
    if requested is not None:
        return templates.get(requested, requested)
    if has_tools and "tool_use" in templates:
        return templates["tool_use"]
    return templates.get("default")


def template_names(templates: Mapping[str, str]) -> Sequence[str]:
    return sorted(templates)
