"""Where a streamed answer's prefill ended, for streams whose first byte does not say it.

A chat or completion stream's first chunk comes with the engine's first output, so the
proxy takes its first byte as the end of the prefill (load accounting, the learned prefill
rate, the step clock). vLLM's `/v1/responses` stream opens with `response.created` and
`response.in_progress` before the engine has run the request at all; its prefill ended when
the first other event arrives (the output item, a delta, or the terminal event of an answer
without text).
"""

from __future__ import annotations

_EVENT = b"event: response."
_OPENING = (b"created\n", b"in_progress\n")


class ResponsesPrefillWatch:
    """Feed the stream's bytes in order; `feed` is True once, for the piece holding the first
    event past the opening ones."""

    __slots__ = ("done",)

    def __init__(self) -> None:
        self.done = False

    def feed(self, data: bytes) -> bool:
        if self.done:
            return False
        at = data.find(_EVENT)
        while at >= 0:
            name_at = at + len(_EVENT)
            name = data[name_at : name_at + 12]
            # (a name cut off at the end of the piece counts as an opening one while it may be)
            if not any(name.startswith(o) or o.startswith(name) for o in _OPENING):
                self.done = True
                return True
            at = data.find(_EVENT, name_at)
        return False
