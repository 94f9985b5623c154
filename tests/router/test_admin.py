"""Admin API and `kvroute inspect` against a live router on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
from pathlib import Path
from typing import Any

import pytest

from kvroute.router.ops import inspect_cli
from tests.router.harness import ADMIN, rig
from tests.router.test_cpu_tier_rate import warmed

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello there"}]}


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_admin_requires_the_token() -> None:
    async def go() -> None:
        async with rig(1) as r:
            assert (await r.client.get("/admin/workers")).status_code == 401
            bad = {"authorization": "Bearer wrong-token"}
            assert (await r.client.get("/admin/workers", headers=bad)).status_code == 401
            ok = await r.client.get("/admin/workers", headers=r.admin_headers())
            assert ok.status_code == 200
        async with rig(1, admin={"token": None}) as r:
            resp = await r.client.get("/admin/workers", headers=r.admin_headers())
            assert resp.status_code == 403 and "disabled" in resp.json()["error"]["message"]

    run(go())


READ = "test-read-only-token"


def test_read_only_token_reads_but_cannot_change_the_fleet() -> None:
    async def go() -> None:
        async with rig(1, admin={"read_token": READ}) as r:
            full, read = r.admin_headers(), {"authorization": f"Bearer {READ}"}
            spec = {"name": "ns/extra", "url": r.engine_urls["w0"], "model": "m"}
            one = "/admin/workers/ns/extra"
            reads = [
                ("GET", "/admin/workers", None),
                ("GET", "/admin/workers/w0", None),
                ("GET", "/admin/decisions", None),
                ("POST", "/admin/score", CHAT),
            ]
            writes = [
                ("POST", "/admin/workers", spec),
                ("POST", f"{one}/drain", None),
                ("POST", f"{one}/undrain", None),
                ("POST", f"{one}/resync", None),
                ("DELETE", f"{one}?drain=false", None),
            ]
            for method, path, body in reads + writes:
                anon = await r.client.request(method, path, json=body)
                assert anon.status_code == 401, (method, path)
            for method, path, body in reads:
                got = await r.client.request(method, path, json=body, headers=read)
                assert got.status_code == 200, (method, path, got.text)
            before = len(r.parts.registry)
            for method, path, body in writes:
                got = await r.client.request(method, path, json=body, headers=read)
                assert got.status_code == 403, (method, path, got.text)
                assert "read-only" in got.json()["error"]["message"]
            assert len(r.parts.registry) == before and r.parts.registry.get("ns/extra") is None
            # the full token does both
            for method, path, body in writes:
                got = await r.client.request(method, path, json=body, headers=full)
                assert got.status_code in (200, 201), (method, path, got.text)
            assert r.parts.registry.get("ns/extra") is None  # added, then removed
            for method, path, body in reads:
                got = await r.client.request(method, path, json=body, headers=full)
                assert got.status_code == 200, (method, path)
            text = (await r.client.get("/metrics")).text
            assert 'kvroute_errors_total{kind="admin_read_only"} 5.0' in text
            assert 'kvroute_errors_total{kind="unauthorized"} 9.0' in text
        # a read-only token alone: the API is on for reading, writes are refused
        async with rig(1, admin={"token": None, "read_token": READ}) as r:
            read = {"authorization": f"Bearer {READ}"}
            assert (await r.client.get("/admin/workers", headers=read)).status_code == 200
            drain = await r.client.post("/admin/workers/w0/drain", headers=read)
            assert drain.status_code == 403

    run(go())


def test_refused_admin_calls_are_logged_once_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def go() -> None:
        async with rig(1, admin={"read_token": READ}) as r:
            read = {"authorization": f"Bearer {READ}"}
            for _ in range(3):
                await r.client.get("/admin/workers", headers={"authorization": "Bearer nope-nope"})
                await r.client.post("/admin/workers/w0/drain", headers=read)

    with caplog.at_level(logging.WARNING, logger="kvroute.router.ops.admin"):
        run(go())
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "kvroute.router.ops.admin"]
    assert len(lines) == 2, lines  # one per kind of refusal, the repeats suppressed
    assert any("'/admin/workers' refused: missing or wrong" in line for line in lines)
    assert any("'/admin/workers/w0/drain' refused: the read-only" in line for line in lines)
    assert not any(READ in line or "nope-nope" in line for line in lines)


def test_admin_tokens_from_files(tmp_path: Path) -> None:
    full_file, read_file = tmp_path / "full", tmp_path / "read"
    full_file.write_text("file-full-token\n")
    read_file.write_text("file-read-token\n")

    async def go() -> None:
        admin = {"token": None, "token_file": str(full_file), "read_token_file": str(read_file)}
        async with rig(1, admin=admin) as r:
            full = {"authorization": "Bearer file-full-token"}
            read = {"authorization": "Bearer file-read-token"}
            assert (await r.client.get("/admin/workers", headers=read)).status_code == 200
            assert (await r.client.post("/admin/workers/w0/drain", headers=read)).status_code == 403
            assert (await r.client.post("/admin/workers/w0/drain", headers=full)).status_code == 200
            old = await r.client.get("/admin/workers", headers=r.admin_headers())
            assert old.status_code == 401

    run(go())


def test_score_explains_without_side_effects() -> None:
    async def go() -> None:
        async with rig(3) as r:
            r.index.scores = {"w0": 0, "w1": 16, "w2": 4}
            resp = await r.client.post("/admin/score", json=CHAT, headers=r.admin_headers())
            assert resp.status_code == 200
            ans = resp.json()
            n = len(b"<user>hello there<assistant>")
            assert ans["chosen"] == "w1" and ans["reason"] == "cache"
            assert ans["prompt_tokens"] == n and ans["token_source"] == "render"
            by = {w["worker"]: w for w in ans["workers"]}
            assert by["w1"]["predicted_reuse"] == 16 and by["w1"]["chosen"] is True
            assert by["w0"]["uncached_tokens"] == n
            assert by["w2"]["est_ttft_s"] > by["w1"]["est_ttft_s"]
            assert by["w1"]["index_reason"] == "scripted" and by["w1"]["groups"] == []
            assert r.index.expected == []  # no expectation, no load, no decision recorded
            assert len(r.parts.decisions) == 0
            assert all(s.received == [] for s in r.engines.values())
            bad = await r.client.post("/admin/score", content=b"{", headers=r.admin_headers())
            assert bad.status_code == 400
            unknown = await r.client.post(
                "/admin/score", json={**CHAT, "model": "x"}, headers=r.admin_headers()
            )
            assert unknown.status_code == 404

    run(go())


def test_workers_listing_and_membership() -> None:
    async def go() -> None:
        async with rig(2) as r:
            h = r.admin_headers()
            await r.client.post("/v1/chat/completions", json=CHAT)
            listing = (await r.client.get("/admin/workers", headers=h)).json()["workers"]
            assert [w["name"] for w in listing] == ["w0", "w1"]
            w = listing[0]
            assert w["status"] == "ready" and w["models"] == ["m"]
            assert w["breaker"]["state"] == "closed"
            assert set(w["load"]) >= {"running", "queued_prefill_tokens", "engine"}
            assert w["index"]["valid"] is True
            assert sum(x["load"]["requests_total"] for x in listing) == 1
            # add, duplicate, bad spec
            new = {"name": "w9", "url": r.engine_urls["w0"], "model": "m"}
            assert (await r.client.post("/admin/workers", json=new, headers=h)).status_code == 201
            assert (await r.client.post("/admin/workers", json=new, headers=h)).status_code == 409
            bad = await r.client.post("/admin/workers", json={"name": "x"}, headers=h)
            assert bad.status_code == 400 and "url" in bad.json()["error"]["message"]
            # drain / undrain / remove
            d = (await r.client.post("/admin/workers/w9/drain", headers=h)).json()
            assert d["state"] == "draining" and d["status"] == "drained"
            u = (await r.client.post("/admin/workers/w9/undrain", headers=h)).json()
            assert u["state"] == "active"
            gone = await r.client.delete("/admin/workers/w9?drain=false", headers=h)
            assert gone.json()["removed"] is True
            assert (await r.client.get("/admin/workers/w9", headers=h)).status_code == 404
            assert (await r.client.post("/admin/workers/nope/drain", headers=h)).status_code == 404
            # a role in the add body shows in the listing; an unknown one is refused
            dec = {"name": "d9", "url": r.engine_urls["w0"], "model": "m", "role": "decode"}
            assert (await r.client.post("/admin/workers", json=dec, headers=h)).status_code == 201
            assert (await r.client.get("/admin/workers/d9", headers=h)).json()["role"] == "decode"
            bad_role = {**dec, "name": "d8", "role": "kv_consumer"}
            refused = await r.client.post("/admin/workers", json=bad_role, headers=h)
            assert refused.status_code == 400 and "role" in refused.json()["error"]["message"]

    run(go())


def test_namespace_pod_worker_names_work_through_http() -> None:
    """Kubernetes workers are named namespace/pod: every per-worker route takes such a name,
    written with a plain or a percent-encoded slash, and a pod named like an action is kept
    apart from the action."""

    async def go() -> None:
        async with rig(1) as r:
            h = r.admin_headers()
            for name in ("team-a/vllm-0", "team-a/drain"):
                spec = {"name": name, "url": r.engine_urls["w0"], "model": "m"}
                added = await r.client.post("/admin/workers", json=spec, headers=h)
                assert added.status_code == 201 and added.json()["name"] == name
            got = await r.client.get("/admin/workers/team-a/vllm-0", headers=h)
            assert got.status_code == 200 and got.json()["name"] == "team-a/vllm-0"
            got = await r.client.get("/admin/workers/team-a%2Fvllm-0", headers=h)
            assert got.status_code == 200 and got.json()["name"] == "team-a/vllm-0"
            # a pod literally named "drain": GET reads it, .../drain/drain drains it
            got = await r.client.get("/admin/workers/team-a/drain", headers=h)
            assert got.status_code == 200 and got.json()["name"] == "team-a/drain"
            d = await r.client.post("/admin/workers/team-a/drain/drain", headers=h)
            assert d.status_code == 200 and d.json()["name"] == "team-a/drain"
            assert r.parts.registry.get("team-a/vllm-0").state == "active"  # type: ignore[union-attr]

            d = await r.client.post("/admin/workers/team-a/vllm-0/drain", headers=h)
            assert d.status_code == 200
            assert d.json()["name"] == "team-a/vllm-0" and d.json()["state"] == "draining"
            u = await r.client.post("/admin/workers/team-a%2Fvllm-0/undrain", headers=h)
            assert u.status_code == 200 and u.json()["state"] == "active"
            rs = await r.client.post("/admin/workers/team-a/vllm-0/resync", headers=h)
            assert rs.status_code == 200 and rs.json()["name"] == "team-a/vllm-0"
            gone = await r.client.delete("/admin/workers/team-a/vllm-0?drain=false", headers=h)
            assert gone.status_code == 200 and gone.json()["removed"] is True
            assert r.parts.registry.get("team-a/vllm-0") is None
            missing = await r.client.get("/admin/workers/team-a/vllm-0", headers=h)
            assert missing.status_code == 404
            assert "team-a/vllm-0" in missing.json()["error"]["message"]
            names = [
                w["name"]
                for w in (await r.client.get("/admin/workers", headers=h)).json()["workers"]
            ]
            assert names == ["w0", "team-a/drain"]

    run(go())


def test_removed_workers_leave_no_metric_series() -> None:
    async def go() -> None:
        async with rig(1) as r:
            h = r.admin_headers()
            spec = {"name": "team-a/vllm-1", "url": r.engine_urls["w0"], "model": "m"}
            assert (await r.client.post("/admin/workers", json=spec, headers=h)).status_code == 201
            await r.client.post("/admin/workers/w0/drain", headers=h)  # traffic to the new one
            for i in range(3):
                body = {**CHAT, "messages": [{"role": "user", "content": f"q{i}"}]}
                assert (await r.client.post("/v1/chat/completions", json=body)).status_code == 200
            await r.client.post("/admin/workers/w0/undrain", headers=h)
            label = 'worker="team-a/vllm-1"'
            text = (await r.client.get("/metrics")).text
            assert f'kvroute_upstream_responses_total{{outcome="2xx",{label}}} 3.0' in text
            assert f"kvroute_upstream_first_byte_seconds_count{{{label}}} 3.0" in text
            assert "kvroute_prediction_outcomes_total{" in text and label in text
            gone = await r.client.delete("/admin/workers/team-a/vllm-1", headers=h)
            assert gone.json()["removed"] is True
            text = (await r.client.get("/metrics")).text
            assert label not in text
            assert 'worker="w0"' in text  # the others keep theirs
            # counted after the removal (a response still in flight then): gone at the scrape
            metrics = r.parts.metrics
            metrics.child(metrics.upstream, "team-a/vllm-1", "2xx").inc()
            assert label not in (await r.client.get("/metrics")).text

    run(go())


def test_decisions_ring_buffer_is_bounded() -> None:
    async def go() -> None:
        async with rig(2, limits={"decisions_buffer": 5}) as r:
            for i in range(8):
                body = {**CHAT, "messages": [{"role": "user", "content": f"q{i}"}]}
                assert (await r.client.post("/v1/chat/completions", json=body)).status_code == 200
            h = r.admin_headers()
            got = (await r.client.get("/admin/decisions?limit=100", headers=h)).json()
            ids = [d["id"] for d in got["decisions"]]
            assert ids == [4, 5, 6, 7, 8]  # only the newest 5 are kept
            d = got["decisions"][-1]
            assert d["status"] == 200 and d["chosen"] in ("w0", "w1")
            assert d["attempts"] == [d["chosen"]] and len(d["candidates"]) == 2
            assert d["reported_cached_tokens"] == 0 and d["token_source"] == "render"
            after = (await r.client.get("/admin/decisions?after=7&candidates=0", headers=h)).json()
            assert [x["id"] for x in after["decisions"]] == [8]
            assert "candidates" not in after["decisions"][0]

    run(go())


def test_inspect_cli_prints_table(tmp_path: Path) -> None:
    async def go() -> None:
        async with rig(2) as r:
            r.index.scores = {"w0": 16, "w1": 0}

            def cli(*argv: str) -> tuple[int, str, str]:
                out, err = io.StringIO(), io.StringIO()
                with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                    code = inspect_cli.main(list(argv))
                return code, out.getvalue(), err.getvalue()

            code, out, _ = await asyncio.to_thread(
                cli, "--router", r.url, "--prompt", "hello there", "--token", ADMIN
            )
            assert code == 0
            assert "chosen: w0  [cache]" in out
            lines = out.splitlines()
            header = next(line for line in lines if line.startswith("worker"))
            assert "reuse" in header and "est_ttft_s" in header
            assert "cpu_tier_rate" not in header  # not learned: every worker's is configured
            row = next(line for line in lines if line.startswith("w0 *"))
            assert " 16 " in row
            convo = tmp_path / "c.json"
            convo.write_text(json.dumps([{"role": "user", "content": "hi"}]))
            code, out, _ = await asyncio.to_thread(
                cli, "--router", r.url, "--messages", str(convo), "--token", ADMIN, "--json"
            )
            assert code == 0 and json.loads(out)["prompt_tokens"] == len(b"<user>hi<assistant>")
            code, _, err = await asyncio.to_thread(
                cli, "--router", r.url, "--prompt", "x", "--token", "wrong-token"
            )
            assert code == 1 and "401" in err

    run(go())


def test_learned_cpu_tier_rates_show_in_admin_inspect_and_metrics() -> None:
    """With `policy.learn_cpu_tier_rate`, each worker's CPU-tier rate is what it is priced
    at: w0's learned, w1's configured (nothing learned yet); without it, none is shown."""

    async def go() -> None:
        async with rig(2, policy={"learn_cpu_tier_rate": True}) as r:
            w0 = r.parts.registry.get("w0")
            assert w0 is not None
            w0.load.cpu_tier, _ = warmed(50_000.0, 5)
            h = r.admin_headers()
            listing = (await r.client.get("/admin/workers", headers=h)).json()["workers"]
            load = {w["name"]: w["load"] for w in listing}
            assert load["w0"]["cpu_tier_tokens_per_s"] == pytest.approx(50_000.0)
            assert load["w0"]["cpu_tier_tokens_per_s_learned"] == pytest.approx(50_000.0)
            assert load["w1"]["cpu_tier_tokens_per_s"] == 200_000.0
            assert load["w1"]["cpu_tier_tokens_per_s_learned"] is None
            score = (await r.client.post("/admin/score", json=CHAT, headers=h)).json()
            by = {w["worker"]: w for w in score["workers"]}
            assert by["w0"]["cpu_tier_tokens_per_s"] == pytest.approx(50_000.0)
            assert by["w1"]["cpu_tier_tokens_per_s"] == 200_000.0
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                code = await asyncio.to_thread(
                    inspect_cli.main, ["--router", r.url, "--prompt", "hi", "--token", ADMIN]
                )
            assert code == 0
            lines = out.getvalue().splitlines()
            header = next(line for line in lines if line.startswith("worker"))
            col = header.index("cpu_tier_rate")
            rows = {line.split()[0]: line for line in lines if line.startswith("w")}
            assert rows["w0"][col:].split()[:2] == ["50000", "learned"]
            assert rows["w1"][col:].split()[:2] == ["200000", "configured"]
            text = (await r.client.get("/metrics")).text
            assert 'kvroute_worker_cpu_tier_tokens_per_second{worker="w1"} 200000.0' in text
            assert 'kvroute_worker_cpu_tier_rate_learned{worker="w0"} 1.0' in text
            assert 'kvroute_worker_cpu_tier_rate_learned{worker="w1"} 0.0' in text
        async with rig(1) as r:
            h = r.admin_headers()
            listing = (await r.client.get("/admin/workers", headers=h)).json()["workers"]
            assert listing[0]["load"]["cpu_tier_tokens_per_s"] is None
            score = (await r.client.post("/admin/score", json=CHAT, headers=h)).json()
            assert score["workers"][0]["cpu_tier_tokens_per_s"] is None
            assert (
                "kvroute_worker_cpu_tier_tokens_per_second{"
                not in (await r.client.get("/metrics")).text
            )

    run(go())


def test_discovery_file_adds_and_drains_workers(tmp_path: Path) -> None:
    import yaml

    path = tmp_path / "workers.yaml"
    path.write_text(yaml.safe_dump({"workers": []}))

    async def go() -> None:
        async with rig(2, discovery={"file": {"path": str(path), "poll_seconds": 0.05}}) as r:
            spec = {"name": "found", "url": r.engine_urls["w1"], "model": "m"}
            path.write_text(yaml.safe_dump({"workers": [spec]}))
            for _ in range(200):
                if r.parts.registry.get("found") is not None:
                    break
                await asyncio.sleep(0.02)
            found = r.parts.registry.get("found")
            assert found is not None and found.spec.url == r.engine_urls["w1"]
            path.write_text(yaml.safe_dump({"workers": []}))
            for _ in range(200):
                if r.parts.registry.get("found") is None:
                    break
                await asyncio.sleep(0.02)
            assert r.parts.registry.get("found") is None  # drained (idle) and removed

    run(go())
