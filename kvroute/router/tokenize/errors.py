"""The one exception type the router turns into an OpenAI 400."""

from __future__ import annotations


class TokenizeError(ValueError):
    """The client's request cannot be tokenized: malformed messages, a template that rejects the
    input, ids that are not token ids, ... The router answers 400 with `str(exc)` as the
    OpenAI error message; `param` names the offending field when known."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
