"""Decoding a JSON body from outside the router: every way it can fail is one clear 400.

msgspec raises more than `DecodeError` on hostile input: `RecursionError` for nesting deeper
than it will follow (`[` x 5,000), `ValidationError` (a `ValueError`) for integers of
thousands of digits and numbers such as `1e999999`, and `UnicodeDecodeError` for invalid
UTF-8 in a string. Each parser of client bodies (the OpenAI endpoints, /tokenize,
/detokenize, admin bodies) decodes through `decode_json`, so none of these reaches the
client as a 500 with a traceback.

What msgspec accepts is bounded further, as no OpenAI field needs more: nesting at most
`MAX_DEPTH` deep (Python code that walks a value, e.g. a chat template, would otherwise hit
the recursion limit later) and integers within 64 bits (msgspec accepts up to 4,300 digits).
The walk that checks this runs only when the raw bytes could hold a violation, so a
32K-token prompt is not walked.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvroute.router.edge.errors import INVALID_JSON, RouterError

_decoder = msgspec.json.Decoder()
_MESSAGE_CHARS = 200  # the decoder's reason, cut so an error body never echoes much input
MAX_DEPTH = 64
_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1
# Any integer outside 64 bits has 19+ digits in a row (below -2**63: 19; above 2**64 - 1:
# 20). Digits map to b"0", all else to a space, and the run is searched for as bytes: 0.05 ms
# for a 56-KB prompt body where a regex took 0.62 ms, 35 times msgspec's decode of it
# (`bench/results/tokenize.md`, "Request body").
_DIGITS_ONLY = bytes(0x30 if 0x30 <= b <= 0x39 else 0x20 for b in range(256))
_LONG_RUN = b"0" * 19


def has_long_digit_run(raw: bytes) -> bool:
    """Whether `raw` holds 19 or more ASCII digits in a row."""
    return _LONG_RUN in raw.translate(_DIGITS_ONLY)


def decode_json(raw: bytes) -> Any:
    """The decoded value of `raw`, or RouterError(INVALID_JSON, 400) saying why not."""
    try:
        value = _decoder.decode(raw)
    except (msgspec.DecodeError, ValueError, RecursionError) as exc:
        # ValueError covers UnicodeDecodeError and out-of-range numbers
        reason = str(exc)[:_MESSAGE_CHARS] or type(exc).__name__
        raise _invalid(f"not valid JSON: {reason}") from None
    if raw.count(b"[") + raw.count(b"{") > MAX_DEPTH or has_long_digit_run(raw):
        _check_shape(value)
    return value


def _check_shape(value: Any) -> None:
    """RouterError if `value` nests deeper than MAX_DEPTH or holds an integer beyond 64 bits
    (iterative: the check itself must not recurse)."""
    if not isinstance(value, dict | list):  # a bare number or string: nothing nests in it
        if type(value) is int and not _INT_MIN <= value <= _INT_MAX:
            raise _invalid("refused: an integer beyond 64 bits")
        return
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        items = node.values() if isinstance(node, dict) else node
        for item in items:
            if isinstance(item, dict | list):
                if depth + 1 > MAX_DEPTH:
                    raise _invalid(f"refused: nested deeper than {MAX_DEPTH} levels")
                stack.append((item, depth + 1))
            elif type(item) is int and not _INT_MIN <= item <= _INT_MAX:
                raise _invalid("refused: an integer beyond 64 bits")


def _invalid(reason: str) -> RouterError:
    return RouterError(INVALID_JSON, f"request body is {reason}")


def decode_object(raw: bytes) -> dict[str, Any]:
    """As `decode_json`, and the value must be a JSON object."""
    body = decode_json(raw)
    if not isinstance(body, dict):
        raise RouterError(INVALID_JSON, "request body must be a JSON object")
    return body
