"""Admin API and `kvroute inspect` against a live router on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
from pathlib import Path
from typing import Any

from kvroute.router.ops import inspect_cli
from tests.router.harness import ADMIN, rig

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
