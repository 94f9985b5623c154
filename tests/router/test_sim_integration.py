"""End to end on loopback: simulated vLLM engines -> real bridges (gRPC) -> router (real
indexer, exact tokenization from the sim's model directory) -> engines. Assertions are on the
cached tokens the engines themselves report, never on time."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvroute.proto import events_pb2
from tests.router.sim_fleet import MODEL, SimRig, sim_fleet
from tests.router.test_events import until

SYSTEM = "You are a meticulous assistant who answers in full sentences. "


def session_messages(s: int) -> list[dict[str, str]]:
    return [
        # the session's own words first: sessions share no prefix, only their own history
        {"role": "system", "content": f"Session {s} concerns topic {s * 7}. " + SYSTEM * 6},
        {"role": "user", "content": f"Tell me about item {s} " * 12},
    ]


async def multi_turn(r: SimRig, sessions: int, turns: int, concurrent: bool = True) -> None:
    async def one(s: int) -> None:
        messages = session_messages(s)
        for turn in range(turns):
            answer = await r.chat(messages)
            messages = [
                *messages,
                {"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
                {"role": "user", "content": f"Follow-up {turn} on item {s}. " * 6},
            ]

    if concurrent:
        await asyncio.gather(*(one(s) for s in range(sessions)))
    else:
        for s in range(sessions):
            await one(s)


def test_cache_aware_beats_round_robin_on_multi_turn_chat() -> None:
    """Sessions of 4 turns on 4 workers: round robin sends every turn of a session to another
    worker, cache-aware routing keeps the conversation where its history is cached."""

    async def go() -> dict[str, Any]:
        results: dict[str, Any] = {}
        for policy in ("ttft", "round_robin"):
            async with sim_fleet(4, policy=policy) as r:
                await multi_turn(r, sessions=5, turns=4, concurrent=False)
                await multi_turn(r, sessions=4, turns=3, concurrent=True)
                records = r.parts.decisions.recent(100)
                prompt = sum(d.reported_prompt_tokens or 0 for d in records)
                results[policy] = (sum(r.cached.values()), prompt, [d.outcome for d in records])
        return results

    results = asyncio.run(go())
    cached_ttft, prompt_ttft, outcomes = results["ttft"]
    cached_rr, _, _ = results["round_robin"]
    assert cached_ttft > 2.2 * cached_rr, (cached_ttft, cached_rr)
    assert cached_ttft > 0.5 * prompt_ttft  # most of every follow-up turn came from cache
    # the router predicted what the engines then reported, request by request
    assert len(outcomes) == 32
    assert outcomes.count("exact") == 32, outcomes


LONG = " ".join(f"token{i}" for i in range(1400))


async def completions_on(r: SimRig, worker: str, prompt: str) -> dict[str, Any]:
    """Send a completion that must land on `worker` (the others drained meanwhile)."""
    others = [w for w in r.engines if w != worker]
    for w in others:
        await r.client.post(f"/admin/workers/{w}/drain", headers=r.admin())
    resp = await r.client.post(
        "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 4}
    )
    for w in others:
        await r.client.post(f"/admin/workers/{w}/undrain", headers=r.admin())
    assert resp.status_code == 200 and resp.headers["x-kvroute-worker"] == worker
    answer: dict[str, Any] = resp.json()
    await r.events_applied()  # what the callers score next depends on what this one stored
    return answer


@pytest.mark.parametrize("profile", ["swa", "mamba"])
def test_hybrid_choice_where_full_attention_only_is_wrong(profile: str) -> None:
    """w0 served a long prompt: its full-attention blocks cover most of the new request, but
    vLLM kept its sliding-window blocks (or Mamba states) only near that prompt's end, so it
    can reuse little there. w1 served a shorter prefix whose end state is intact."""
    request = LONG[: len(LONG) * 9 // 10] + " and a new ending"

    async def scenario(policy: str) -> tuple[str, int, dict[str, int], dict[str, Any]]:
        async with sim_fleet(2, profile=profile, policy=policy) as r:
            await completions_on(r, "w0", LONG)
            await completions_on(r, "w1", LONG[: len(LONG) * 3 // 4])
            body = {"model": MODEL, "prompt": request, "max_tokens": 4}
            truth = {w: await r.probe(w, body) for w in r.engines}
            await until(lambda: r.parts.decisions.recent(1)[0].status == 200)
            score = (
                await r.client.post(
                    "/admin/score?endpoint=/v1/completions", json=body, headers=r.admin()
                )
            ).json()
            resp = await r.client.post("/v1/completions", json=body)
            chosen = resp.headers["x-kvroute-worker"]
            cached = resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            return chosen, cached, truth, score

    chosen, cached, truth, score = asyncio.run(scenario("ttft"))
    assert truth["w0"] < truth["w1"]  # what vLLM itself would reuse
    by = {w["worker"]: w for w in score["workers"]}
    assert by["w0"]["full_attention_only_reuse"] > by["w1"]["full_attention_only_reuse"]
    assert {w: by[w]["predicted_reuse"] for w in truth} == truth  # exact, per worker
    assert chosen == "w1" and cached == truth["w1"]
    fa_chosen, fa_cached, fa_truth, _ = asyncio.run(scenario("full_attention_only"))
    assert fa_chosen == "w0" and fa_cached == fa_truth["w0"] < cached


def test_affinity_keeps_a_shared_prefix_together_on_a_hybrid_model() -> None:
    """Nothing is reusable for a new request whose prefix sits in w-x's full-attention blocks
    (its sliding-window state is gone there); the router still sends it to w-x, which stores
    the state at that junction, so the next requests sharing the prefix reuse it."""
    base = LONG[: len(LONG) * 8 // 10]

    async def go() -> None:
        async with sim_fleet(3, profile="swa") as r:

            async def send(prompt: str) -> tuple[str, int, str]:
                body = {"model": MODEL, "prompt": prompt, "max_tokens": 4}
                resp = await r.client.post("/v1/completions", json=body)
                cached = resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                reason = r.parts.decisions.recent(1)[0].decision.reason
                # the next request is about what this one stored: let its events arrive (a
                # 14 ms answer can beat them to the router; that lag is not what this tests)
                await r.events_applied()
                return resp.headers["x-kvroute-worker"], cached, reason

            home, _, _ = await send(LONG)
            second = await send(base + " first question")
            assert second == (home, 0, "affinity")
            third = await send(base + " second question")
            assert third[0] == home and third[1] > 0.7 * len(base) / 6 and third[2] == "cache"

    asyncio.run(go())


def test_junction_credit_only_for_a_prefix_another_session_asked_for() -> None:
    """A conversation's own history earns no junction credit (wherever its next request is
    served, vLLM keeps the state at that prompt's end); a prefix another session asked for
    does."""
    base = LONG[: len(LONG) * 8 // 10]
    shorter = LONG[: len(LONG) * 6 // 10]

    async def go() -> None:
        async with sim_fleet(3, profile="swa") as r:

            async def send(prompt: str, user: str) -> tuple[str, int, str, int]:
                body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "user": user}
                resp = await r.client.post("/v1/completions", json=body)
                cached = resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                decision = r.parts.decisions.recent(1)[0].decision
                assert decision.chosen is not None
                await r.events_applied()
                reason, affinity = decision.reason, decision.chosen.affinity
                return resp.headers["x-kvroute-worker"], cached, reason, affinity

            # the router remembers prompts once it knows the fleet is hybrid (its first events)
            await send("an unrelated warm-up prompt " * 20, "warm-up")
            home, _, _, _ = await send(LONG, "alice")
            # nothing reusable and no credit for her own prefix: the cold rule (her hash)
            own = await send(base + " a question of her own", "alice")
            assert own[1:] == (0, "session", 0)
            # bob's prompt shares a prefix alice asked for, with no state at its end anywhere
            other = await send(shorter + " bob's question", "bob")
            assert other[:3] == (home, 0, "affinity")
            assert other[3] > 0.7 * len(shorter) / 6

    asyncio.run(go())


def test_salted_and_lora_requests_stay_in_their_namespace() -> None:
    async def go() -> None:
        async with sim_fleet(3, engine={"lora_adapters": ("sql-lora",)}) as r:
            msgs = session_messages(1)
            first = await r.chat(msgs, cache_salt="tenant-a")
            again = await r.chat(
                [*msgs, {"role": "user", "content": "more"}], cache_salt="tenant-a"
            )
            assert again["_worker"] == first["_worker"]
            assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            other = await r.chat(msgs, cache_salt="tenant-b")  # same text, another tenant
            assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            assert r.parts.decisions.recent(1)[0].decision.predicted_reuse == 0
            lora = await r.chat(session_messages(2), model="sql-lora")
            lora2 = await r.chat([*session_messages(2), {"role": "user", "content": "x"}],
                                 model="sql-lora")  # fmt: skip
            assert lora2["_worker"] == lora["_worker"]
            assert lora2["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            base = await r.chat(session_messages(2))  # base model: the adapter's cache is not its
            assert base["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            assert r.parts.decisions.recent(1)[0].decision.predicted_reuse == 0
            outcomes = [d.outcome for d in r.parts.decisions.recent(10)]
            assert outcomes.count("exact") == len(outcomes), outcomes

    asyncio.run(go())


def test_spill_under_a_hot_prefix_warms_a_second_copy() -> None:
    hot = SYSTEM * 40

    async def go() -> None:
        async with sim_fleet(
            3,
            engine={"speed": 5.0},
            router={"policy": {"name": "ttft", "max_running_per_worker": 3}},
        ) as r:
            await r.chat([{"role": "system", "content": hot}, {"role": "user", "content": "0"}])
            home = r.parts.decisions.recent(1)[0].attempts[0]
            burst = [
                r.chat([{"role": "system", "content": hot}, {"role": "user", "content": f"q{i}"}])
                for i in range(12)
            ]
            answers = await asyncio.gather(*burst)
            used = {a["_worker"] for a in answers}
            reasons = [d.decision.reason for d in r.parts.decisions.recent(12)]
            assert "spill" in reasons and len(used) >= 2
            # the hot prefix now lives on a second worker too: it reuses it when asked
            body = {"model": MODEL, "messages": [{"role": "system", "content": hot},
                                                 {"role": "user", "content": "later"}]}  # fmt: skip
            warm = [w for w in r.engines if w != home and await r.probe(w, body) > 400]
            assert warm, "no second copy of the hot prefix"

    asyncio.run(go())


def test_session_affinity_without_cache_evidence() -> None:
    async def go() -> None:
        async with sim_fleet(3) as r:
            workers = set()
            for i in range(6):
                a = await r.chat([{"role": "user", "content": f"{i} unrelated question {i * 31}"}],
                                 user="alice")  # fmt: skip
                workers.add(a["_worker"])
            assert len(workers) == 1
            assert r.parts.decisions.recent(6)[0].decision.reason == "session"

    asyncio.run(go())


def test_retry_when_the_engine_fails() -> None:
    async def go() -> None:
        async with sim_fleet(2) as r:
            msgs = session_messages(3)
            first = await r.chat(msgs)
            await r.fault(first["_worker"], fail_next=1)
            again = await r.chat(msgs)  # goes to the same (cache) worker, fails, is retried
            record = r.parts.decisions.recent(1)[0]
            assert record.attempts == [first["_worker"], again["_worker"]]
            assert again["_worker"] != first["_worker"]

    asyncio.run(go())


def test_resync_after_drift() -> None:
    """The router's view of w0 is corrupted (it claims prompts w0 never saw); predictions miss,
    the view is discarded and reloaded from the bridge's snapshot, and predictions match
    again."""
    prompts = [[1000 + 300 * i + j for j in range(320)] for i in range(8)]  # vocab: 4096

    async def go() -> None:
        async with sim_fleet(
            2, router={"verify": {"window": 4, "min_samples": 4, "miss_fraction": 0.75}}
        ) as r:
            op = events_pb2.KvGroupEvent
            lie = events_pb2.Snapshot(
                sequence=0,
                has_sequence=False,
                stream_id="bogus",
                events=[
                    op(
                        operation=op.STORE,
                        group_id=0,
                        block_hashes=[(i << 16 | b).to_bytes(8, "big") for b in range(20)],
                        token_ids=p,
                        block_size=16,
                        kind="full_attention",
                    )
                    for i, p in enumerate(prompts)
                ],
            )
            r.parts.index.apply_snapshot("w0", lie)
            outcomes = []
            for p in prompts[:6]:
                resp = await r.client.post(
                    "/v1/completions", json={"model": MODEL, "prompt": p, "max_tokens": 2}
                )
                assert resp.status_code == 200
                outcomes.append(r.parts.decisions.recent(1)[0].outcome)
            assert outcomes[:4] == ["over"] * 4  # the lie: predicted reuse the engine lacks
            await until(lambda: r.parts.verifier.accuracy("w0").resyncs == 1)  # type: ignore[union-attr]
            assert outcomes[4:] == ["exact", "exact"]  # the reloaded view is true again
            workers = (await r.client.get("/admin/workers", headers=r.admin())).json()["workers"]
            w0 = next(w for w in workers if w["name"] == "w0")
            assert w0["prediction"]["resyncs"] == 1 and w0["events"]["snapshots"] >= 2

    asyncio.run(go())


def test_in_process_zmq_subscription_and_engine_load() -> None:
    """Without a bridge process: the router follows each engine's ZMQ socket itself (the
    bridge's follower and converter in-process); engine load comes from /metrics."""

    async def go() -> None:
        async with sim_fleet(2, via="zmq") as r:
            msgs = session_messages(5)
            first = await r.chat(msgs)
            second = await r.chat([*msgs, {"role": "user", "content": "and more"}])
            assert second["_worker"] == first["_worker"]
            assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            assert r.parts.decisions.recent(1)[0].outcome == "exact"
            status = r.parts.events.status("w0")
            assert status is not None and status.state == "live" and status.snapshots >= 1
            w0 = r.parts.registry.get("w0")
            await until(lambda: w0 is not None and w0.load.engine is not None)
            listing = (await r.client.get("/admin/workers", headers=r.admin())).json()
            engine = listing["workers"][0]["load"]["engine"]
            assert engine is not None and engine["kv_usage"] is not None

    asyncio.run(go())


def test_router_learns_the_engines_prefill_rate_from_streamed_first_bytes() -> None:
    """Configured 100x too fast, the router learns the simulated GPU's prefill rate from the
    first bytes of streamed requests (the sim, like vLLM, sends nothing before the prefill)."""
    from kvroute.sim.timing import DEFAULT_GPU, chunk_context

    speed = 1.0

    def modelled_s(n: int) -> float:  # one prefill chunk alone on the modelled GPU
        return DEFAULT_GPU.step_seconds(n, chunk_context(0, n), 0, 0) / speed

    true_rate = (1800 - 200) / (modelled_s(1800) - modelled_s(200))

    async def go() -> float:
        router = {
            "policy": {
                "name": "ttft",
                "prefill_tokens_per_s": 100 * true_rate,
                "learn_prefill_rate": True,
            }
        }
        async with sim_fleet(1, engine={"speed": speed}, router=router) as r:
            for i in range(48):
                words = 200 + (i * 37) % 1600  # distinct prompts, spread sizes, no reuse
                body = {
                    "model": MODEL,
                    "prompt": f"p{i} " + " ".join(f"t{i}x{k}" for k in range(words // 3)),
                    "max_tokens": 1,
                    "stream": True,
                }
                async with r.client.stream("POST", "/v1/completions", json=body) as resp:
                    assert resp.status_code == 200
                    async for _ in resp.aiter_bytes():
                        pass
            text = (await r.client.get("/metrics")).text
        values = {
            x.split()[0]: float(x.split()[-1])
            for x in text.splitlines()
            if x.startswith("kvroute_prefill_tokens_per_second")
        }
        # with learn_prefill_rate on, the policy uses what was measured
        assert values["kvroute_prefill_tokens_per_second"] == pytest.approx(
            values["kvroute_prefill_tokens_per_second_measured"]
        )
        return values["kvroute_prefill_tokens_per_second_measured"]

    learned = asyncio.run(go())
    assert true_rate / 2.5 < learned < true_rate * 2.5, (learned, true_rate)


async def stream_chat(r: SimRig, messages: list[dict[str, str]]) -> tuple[str, int, int]:
    """One streamed chat through the router: (answer text, predicted cached tokens from the
    response header, cached tokens from the engine's usage chunk)."""
    import json

    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": 160,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    text, cached = [], -1
    async with r.client.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        predicted = int(resp.headers["x-kvroute-predicted-cached-tokens"])
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                text.append(choice["delta"].get("content") or "")
            if chunk.get("usage"):
                cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
    return "".join(text), predicted, cached


@pytest.mark.parametrize("profile", ["dense", "mamba"])
def test_streamed_turns_routed_on_their_history_are_predicted_exactly(profile: str) -> None:
    """A streamed turn whose history is in the tokenizer's prefix cache and whose new text is
    long is routed on the history's ids and encoded after dispatch (tokenizer
    partial_min_chars); the prediction the router reports is still that of the whole prompt,
    request by request equal to what the engine reused."""

    async def go() -> tuple[list[tuple[int, int]], float]:
        pairs: list[tuple[int, int]] = []
        async with sim_fleet(3, profile=profile) as r:
            for s in range(3):
                messages = session_messages(s)
                for turn in range(4):
                    answer, predicted, cached = await stream_chat(r, messages)
                    await r.events_applied()
                    if turn:
                        pairs.append((predicted, cached))
                    messages = [
                        *messages,
                        {"role": "assistant", "content": answer},
                        # ~600 characters of new text (partial_min_chars is 512)
                        {"role": "user", "content": f"Follow-up {turn} on item {s}. " * 24},
                    ]
            text = (await r.client.get("/metrics")).text
        rest = sum(
            float(x.split()[-1])
            for x in text.splitlines()
            if x.startswith('kvroute_tokenize_seconds_count{mode="local_rest"}')
        )
        return pairs, rest

    pairs, rest = asyncio.run(go())
    assert rest >= len(pairs)  # every follow-up turn took the partial path
    assert all(cached > 0 for _, cached in pairs), pairs
    assert all(p == c for p, c in pairs), pairs


def test_router_learns_each_engines_step_period_from_relayed_chunks() -> None:
    """Streams through the router tick each worker's step clock: the learned period matches
    the simulated engine's modelled step time, shown in /admin/workers and /metrics."""
    from kvroute.sim.timing import DEFAULT_GPU

    speed = 0.5  # decode steps of ~14 ms, well above the 3 ms merge window
    streams = 3

    async def one(r: SimRig, i: int, max_tokens: int) -> None:
        body = {
            "model": MODEL,
            "prompt": f"s{i} " + " ".join(f"w{i}x{k}" for k in range(60)),
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
        }
        async with r.client.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            async for _ in resp.aiter_bytes():
                pass

    async def go() -> tuple[dict[str, Any], dict[str, Any], str]:
        async with sim_fleet(1, engine={"speed": speed}) as r:
            running = [asyncio.create_task(one(r, i, 60)) for i in range(streams)]
            await asyncio.sleep(0.5)  # their decode steps are ticking the clock by now
            await one(r, 99, 1)
            await asyncio.gather(*running)
            workers = (await r.client.get("/admin/workers", headers=r.admin())).json()
            decisions = (await r.client.get("/admin/decisions", headers=r.admin())).json()
            metrics = (await r.client.get("/metrics")).text
            return workers, decisions, metrics

    workers, decisions, metrics = asyncio.run(go())
    period = workers["workers"][0]["load"]["step_period_s"]
    # three streams decoding at ~90 tokens of context each
    modelled = DEFAULT_GPU.step_seconds(0, 0, streams, streams * 90) / speed
    assert period is not None and 0.7 * modelled < period < 1.6 * modelled, (period, modelled)
    assert f'kvroute_worker_step_period_seconds{{worker="w0"}} {period}' in metrics
    assert len(decisions["decisions"]) == streams + 1
