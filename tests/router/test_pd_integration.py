"""A real `kvroute serve` in front of a real prefill/decode fleet (`kvroute sim fleet --workers 1
--prefill 2 --decode 2`: simulated engines with vLLM's P/D protocol, each with its bridge), on
loopback. A request for the P/D pool goes to a prefill worker first, then to a decode worker
with the prefill's kv_transfer_params; the client sees the answer the mixed pool gives."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.router.pd_rig import ADMIN, AUTH, PdRig, pd_rig

SYSTEM = "You answer questions about disaggregated serving in full sentences. " * 8


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PdRig]:
    with pd_rig(tmp_path_factory.mktemp("pd")) as r:
        yield r


def _chat(model: str, messages: list[dict[str, str]], **kw: Any) -> dict[str, Any]:
    return {"model": model, "messages": messages, "max_tokens": 12, **kw}


def _completion(model: str, prompt: str, **kw: Any) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": 12, **kw}


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = httpx.post(url, json=body, timeout=30)
    assert resp.status_code == 200, resp.text
    out: dict[str, Any] = resp.json()
    return out


def _stream(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=30) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def _shape(obj: Any) -> Any:
    """The keys of a JSON answer, recursively (values left out)."""
    if isinstance(obj, dict):
        return {k: _shape(v) for k, v in obj.items() if k not in ("id", "created")}
    if isinstance(obj, list):
        return [_shape(v) for v in obj[:1]]
    return type(obj).__name__


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_pd_answers_have_the_shape_of_a_whole_answer(rig: PdRig, endpoint: str) -> None:
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    if endpoint == "chat":
        body = _chat(rig.model, [{"role": "user", "content": f"{SYSTEM} Shape of {endpoint}?"}])
    else:
        body = _completion(rig.model, f"{SYSTEM} Shape of {endpoint}?")
    body["ignore_eos"] = True
    # what the router answers from the mixed pool (the P/D pool drained meanwhile)
    rig.drain("sim-0", undrain=True)
    rig.drain("prefill-0", "prefill-1")
    try:
        whole = _post(rig.url + path, body)
        assert rig.last()["pd"] is None and rig.last()["chosen"] == "sim-0"
        whole_chunks = _stream(rig.url + path, body)
    finally:
        rig.drain("prefill-0", "prefill-1", undrain=True)
        rig.drain("sim-0")

    answer = _post(rig.url + path, body)
    assert _shape(answer) == _shape(whole)
    assert answer.get("kv_transfer_params") is None  # the handoff stays between the engines
    assert answer["usage"]["completion_tokens"] == 12
    assert answer["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"]
    record = rig.last()
    pd = record["pd"]
    assert [a["outcome"] for a in pd["prefill"]] == ["200"]
    assert pd["prefill"][0]["worker"].startswith("prefill-")
    assert record["chosen"] == pd["prefill"][0]["worker"]
    assert [a["outcome"] for a in pd["decode"]] == ["200"]
    assert pd["decode"][0]["worker"].startswith("decode-")
    assert {c["worker"] for c in pd["decode_candidates"]} == {"decode-0", "decode-1"}

    chunks = _stream(rig.url + path, body)
    assert [_shape(c) for c in chunks] == [_shape(c) for c in whole_chunks]
    text_of = (
        (lambda c: c["choices"][0]["delta"].get("content", ""))
        if endpoint == "chat"
        else (lambda c: c["choices"][0]["text"])
    )
    assert "".join(text_of(c) for c in chunks if c["choices"])
    assert all(c.get("kv_transfer_params") is None for c in chunks)
    assert rig.last()["pd"]["decode"][0]["outcome"] == "200"


def test_a_conversation_comes_back_to_its_decode_worker_and_pulls_less(rig: PdRig) -> None:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Turn 0?"}]
    chosen, pulls = [], []
    for turn in range(3):
        answer = _post(rig.url + "/v1/chat/completions", _chat(rig.model, messages))
        record = rig.last()
        pd = record["pd"]
        decode = pd["decode"][-1]["worker"]
        chosen.append(decode)
        cand = next(c for c in pd["decode_candidates"] if c["worker"] == decode)
        pulls.append((cand["uncached_tokens"], record["prompt_tokens"]))
        messages += [
            {"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
            {"role": "user", "content": f"And turn {turn + 1}? " * 4},
        ]
    assert len(set(chosen)) == 1, chosen  # the worker that holds the conversation
    first_pull, first_prompt = pulls[0]
    assert first_pull == first_prompt  # nothing held at first
    for pull, prompt in pulls[1:]:
        assert pull < prompt / 2, pulls  # later turns pull only what is new
    # the decode engine says the same: its pulls moved fewer blocks than the prompts hold
    state = rig.state(chosen[0])["kv_transfer"]
    assert state["pulls"].get("ok", 0) >= 3


def test_a_failing_prefill_worker_is_retried_on_the_other(rig: PdRig) -> None:
    before = rig.metric("kvroute_pd_retries_total", 'phase="prefill"')
    rig.faults("prefill-0", fail_rate=1.0)
    rig.faults("prefill-1", fail_rate=0.0)
    try:
        records = []
        # fewer failures than breaker.failure_threshold (5): prefill-0 stays usable later
        for i in range(4):
            prompt = f"Prefill failover request {i}. " * 20
            answer = _post(rig.url + "/v1/completions", _completion(rig.model, prompt))
            assert answer["choices"][0]["text"] is not None
            records.append(rig.last()["pd"])
    finally:
        rig.faults("prefill-0", fail_rate=0.0)
    # every answer's prefill ended on prefill-1; some first tried the failing prefill-0
    assert all(r["prefill"][-1] == {**r["prefill"][-1], "worker": "prefill-1", "outcome": "200"}
               for r in records)  # fmt: skip
    failed_over = [r for r in records if len(r["prefill"]) > 1]
    assert failed_over, records
    assert failed_over[0]["prefill"][0]["worker"] == "prefill-0"
    assert failed_over[0]["prefill"][0]["outcome"] == "500"
    assert rig.metric("kvroute_pd_retries_total", 'phase="prefill"') > before


def test_a_decode_worker_failing_before_its_first_byte_is_retried_with_the_same_params(
    rig: PdRig,
) -> None:
    prompt = "Decode failover. " * 30
    _post(rig.url + "/v1/completions", _completion(rig.model, prompt))
    holder = rig.last()["pd"]["decode"][-1]["worker"]  # chosen first for the same prompt again
    rig.faults(holder, fail_next=1)
    try:
        answer = _post(rig.url + "/v1/completions", _completion(rig.model, prompt))
    finally:
        rig.faults(holder, fail_next=0)
    assert answer["usage"]["completion_tokens"] == 12
    pd = rig.last()["pd"]
    # one prefill; the first decode worker failed, the other one pulled the same blocks
    assert [a["outcome"] for a in pd["prefill"]] == ["200"]
    assert len(pd["decode"]) == 2 and pd["decode"][0]["outcome"] == "5xx"
    assert pd["decode"][1]["outcome"] == "200"
    assert pd["decode"][0]["worker"] == holder != pd["decode"][1]["worker"]
    held = sum(rig.state(w)["kv_transfer"]["leases_held"] for w in ("prefill-0", "prefill-1"))
    assert held == 0  # the second decode's pull freed the prefill's blocks


def test_client_disconnect_cancels_the_decode(rig: PdRig) -> None:
    body = _completion(rig.model, "A long answer, please. " * 20, max_tokens=3000, stream=True,
                       ignore_eos=True)  # fmt: skip
    raw = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
        f"content-length: {len(raw)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", rig.port), timeout=10) as sock:
        sock.sendall(head + raw)
        got = b""
        while b"data: " not in got:
            got += sock.recv(4096)
        running = sum(rig.state(w)["running"] for w in ("decode-0", "decode-1"))
        assert running == 1  # the decode is streaming
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if sum(rig.state(w)["running"] for w in ("decode-0", "decode-1")) == 0:
            break
        time.sleep(0.1)
    assert sum(rig.state(w)["running"] for w in ("decode-0", "decode-1")) == 0


def test_without_decode_workers_only_the_mixed_pool_serves(rig: PdRig) -> None:
    body = _completion(rig.model, "Who serves this without a decode pool? " * 5)
    rig.drain("decode-0", "decode-1")
    try:
        refused = httpx.post(rig.url + "/v1/completions", json=body, timeout=30)
        assert refused.status_code == 503  # prefill workers alone cannot answer
        rig.drain("sim-0", undrain=True)
        _post(rig.url + "/v1/completions", body)
        assert rig.last()["pd"] is None and rig.last()["chosen"] == "sim-0"
    finally:
        rig.drain("sim-0")
        rig.drain("decode-0", "decode-1", undrain=True)


def test_inspect_and_score_explain_both_halves(rig: PdRig) -> None:
    body = {"model": rig.model, "messages": [{"role": "user", "content": SYSTEM}]}
    url = rig.url + "/admin/score?endpoint=/v1/chat/completions"
    score = httpx.post(url, json=body, headers=AUTH, timeout=10).json()
    assert score["chosen"].startswith("prefill-") and score["decode_chosen"].startswith("decode-")
    by = {w["worker"]: w for w in score["workers"]}
    assert by["decode-0"]["role"] == "decode" and not by["decode-0"]["eligible"]
    assert set(by["decode-0"]["decode"]["terms"]) == {"transfer", "decode_load"}
    assert "decode" not in by["prefill-0"]
    assert score["link_bytes_per_s"] == 400e9 / 8  # pd.link_gbps (not learning)
    out = subprocess.run(
        [sys.executable, "-m", "kvroute", "inspect", "--router", rig.url, "--prompt", SYSTEM],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "KVROUTE_ADMIN__TOKEN": ADMIN},
        check=False,
    )
    assert out.returncode == 0, out.stderr
    # equal decode workers take turns, so inspect's own scoring may pick the other one
    assert score["decode_chosen"] in ("decode-0", "decode-1")
    assert any(f"decode: decode-{i}" in out.stdout for i in (0, 1))
    lines = out.stdout.splitlines()
    rows = {ln.split()[0]: ln.replace(" *", "").split() for ln in lines if ln[:1] in ("p", "d")}
    assert rows["decode-0"][1] == "decode" and rows["prefill-0"][1] == "prefill"


def test_client_disconnect_during_the_prefill_cancels_it(rig: PdRig) -> None:
    prefills = ("prefill-0", "prefill-1")
    granted = sum(rig.state(w)["kv_transfer"]["leases_granted"] for w in prefills)
    for w in prefills:
        rig.faults(w, slowdown=3000.0)  # a prefill step now takes about a second
    try:
        # longer than one step's token budget (2048): the abort lands between two chunks
        body = _completion(rig.model, "Cancel me while I prefill. " * 200)
        raw = json.dumps(body).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
            f"content-length: {len(raw)}\r\n\r\n"
        ).encode()
        with socket.create_connection(("127.0.0.1", rig.port), timeout=10) as sock:
            sock.sendall(head + raw)
            deadline = time.monotonic() + 10
            while sum(rig.state(w)["running"] for w in prefills) == 0:
                assert time.monotonic() < deadline, "the prefill never started"
                time.sleep(0.05)
        # the router drops the prefill's connection; the engine aborts it at its next step
        deadline = time.monotonic() + 15
        while sum(rig.state(w)["running"] for w in prefills) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sum(rig.state(w)["running"] for w in prefills) == 0
    finally:
        for w in prefills:
            rig.faults(w, slowdown=1.0)
    # aborted, not finished: no blocks were kept for a decode, and no decode started
    assert sum(rig.state(w)["kv_transfer"]["leases_granted"] for w in prefills) == granted
    assert sum(rig.state(w)["running"] for w in ("decode-0", "decode-1")) == 0


def test_a_request_that_cannot_be_split_goes_to_the_mixed_pool(rig: PdRig) -> None:
    body = {"model": rig.model, "prompt": ["first prompt", "second prompt"], "max_tokens": 4}
    refused = httpx.post(rig.url + "/v1/completions", json=body, timeout=30)
    assert refused.status_code == 400
    assert "one prompt with n=1" in refused.json()["error"]["message"]
    rig.drain("sim-0", undrain=True)
    try:
        answer = _post(rig.url + "/v1/completions", body)
        assert len(answer["choices"]) == 2
        assert rig.last()["pd"] is None and rig.last()["chosen"] == "sim-0"
    finally:
        rig.drain("sim-0")


def test_new_conversations_spread_over_the_decode_pool(rig: PdRig) -> None:
    chosen = []
    for s in range(4):
        # different from the first token on: no decode worker holds any of it
        prompt = f"{s * 7919} starts a new conversation about nothing held anywhere. " * 6
        _post(rig.url + "/v1/completions", _completion(rig.model, prompt))
        chosen.append(rig.last()["pd"]["decode"][-1]["worker"])
    assert chosen.count("decode-0") == chosen.count("decode-1") == 2, chosen


def test_when_every_decode_worker_fails_the_request_is_prefilled_again(rig: PdRig) -> None:
    # the second prefill needs the other prefill worker: no breaker may be open from before
    rig.wait_ready("prefill-0", "prefill-1", "decode-0", "decode-1")
    before = rig.metric("kvroute_pd_retries_total", 'phase="decode"')
    for w in ("decode-0", "decode-1"):
        rig.faults(w, fail_next=1)
    try:
        answer = _post(rig.url + "/v1/completions", _completion(rig.model, "Both fail. " * 30))
    finally:
        for w in ("decode-0", "decode-1"):
            rig.faults(w, fail_next=0)
    assert answer["usage"]["completion_tokens"] == 12
    pd = rig.last()["pd"]
    assert [a["outcome"] for a in pd["prefill"]] == ["200", "200"]  # prefilled twice
    assert [a["outcome"] for a in pd["decode"]] == ["5xx", "5xx", "200"]
    assert rig.metric("kvroute_pd_retries_total", 'phase="decode"') > before
    # the first prefill's blocks, never pulled, are kept until the lease runs out
    held = sum(rig.state(w)["kv_transfer"]["leases_held"] for w in ("prefill-0", "prefill-1"))
    assert held == 1
