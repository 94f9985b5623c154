"""The tokenization benchmark runs in --smoke mode and writes its results."""

from __future__ import annotations

import json
from pathlib import Path

from bench import tokenize_bench


def test_tokenize_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "tokenize.json"
    assert tokenize_bench.main(["--smoke", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["benchmark"] == "tokenize" and result["smoke"] is True
    (row,) = result["results"]
    assert row["tokens"] > 500 and row["cold_ms"] > 0
    # the next turn encoded only what was new, not the whole conversation
    assert 0 < row["multi_turn_last_encoded_tokens"] < row["tokens"]
    assert set(row["executors"]) == {"inline", "thread1", "thread2", "process2"}
    assert (tmp_path / "tokenize.md").read_text().startswith("# Tokenization")
    # a completions prompt extending a seen one: every one hit the cache, and what was
    # encoded is the new text (750 tokens), not the earlier prompt again
    c = result["completions"]
    assert c["extending_hits"] == c["reps"] > 0
    assert c["prompt_tokens"] - c["earlier_tokens"] == 750
    assert 750 <= c["extending_encoded_tokens"] < 800
    # departing before the earlier prompt's end (its partial last block replaced): every one
    # hit the cache and encoded about the new text, not the shared blocks
    assert c["departing_hits"] == c["reps"]
    assert 750 <= c["departing_encoded_tokens"] < 750 + 2 * c["partial_tokens"] + 64
    # the request body of such a prompt was decoded, and the check timed beside the regex
    body = c["body"]
    assert body["bytes"] > 4_000  # smoke prompts are short
    for key in ("msgspec_decode_ms", "decode_json_ms", "digit_check_ms", "digit_regex_ms"):
        assert body[key] > 0, key
