"""Who may subscribe: the bridge's token and TLS, through real gRPC on loopback, and the
options that configure them (files only, never a value on the command line)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import grpc.aio
import pytest
import zmq.asyncio
from bridge_testkit import FakeEngine, be, eventually, store

from kvroute.bridge.app import Bridge, BridgeConfig
from kvroute.bridge.auth import ServerTls, call_metadata, channel_credentials
from kvroute.bridge.cli import build_parser, config_from_args
from kvroute.bridge.client import SUBSCRIBE_METHOD, subscribe
from kvroute.proto.events_pb2 import KvGroupEvent, SubscribeRequest, SubscribeResponse
from tests.common.throwaway_pki import Pki, make_pki

TOKEN = b"0123456789abcdef-bridge-token"
TOKENS = list(range(1000, 1016))


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


async def first_message(
    target: str,
    *,
    credentials: grpc.ChannelCredentials | None = None,
    metadata: tuple[tuple[str, str], ...] = (),
    server_name: str | None = None,
) -> SubscribeResponse:
    """The bridge's first answer to one Subscribe (AioRpcError if it refuses)."""
    options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    channel = (
        grpc.aio.secure_channel(target, credentials, options=options)
        if credentials is not None
        else grpc.aio.insecure_channel(target)
    )
    async with channel:
        method = channel.unary_stream(
            SUBSCRIBE_METHOD,
            request_serializer=SubscribeRequest.SerializeToString,
            response_deserializer=SubscribeResponse.FromString,
        )
        call = method(SubscribeRequest(dp_rank=0), metadata=metadata, timeout=5)
        async for message in call:
            call.cancel()
            assert isinstance(message, SubscribeResponse)
            return message
    raise AssertionError("the stream ended without a message")


def run(test: Callable[[FakeEngine, Callable[..., Awaitable[Bridge]]], Awaitable[None]]) -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        async with contextlib.AsyncExitStack() as stack:
            engine = FakeEngine(ctx)
            stack.push_async_callback(engine.close)

            async def bridge(**config: object) -> Bridge:
                b = Bridge(
                    BridgeConfig(engines=(engine.endpoints(),), listen="127.0.0.1:0", **config)  # type: ignore[arg-type]
                )
                await b.start()
                stack.push_async_callback(b.stop)
                return b

            await test(engine, bridge)
        ctx.destroy(linger=0)

    asyncio.run(asyncio.wait_for(main(), 60))


def rejected(bridge: Bridge, reason: str) -> float:
    value = bridge.metrics.registry.get_sample_value(
        "kvroute_bridge_rejected_subscriptions_total", {"reason": reason}
    )
    return value or 0.0


def test_a_subscription_without_the_token_is_unauthenticated() -> None:
    async def main(engine: FakeEngine, start: Callable[..., Awaitable[Bridge]]) -> None:
        bridge = await start(token=TOKEN)
        target = f"127.0.0.1:{bridge.grpc_port}"
        for metadata in ((), call_metadata(b"wrong-token"), (("authorization", "Basic x"),)):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await first_message(target, metadata=metadata)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert rejected(bridge, "unauthenticated") == 3
        assert bridge.streams[0].subscriber_count == 0
        # the token opens it, and the stream then carries the engine's batches
        await asyncio.sleep(0.3)
        await engine.publish([store([7], None, TOKENS)])
        got: list[SubscribeResponse] = []
        async for message in subscribe(target, token=TOKEN):
            got.append(message)
            if any(be(7) in e.block_hashes for m in got for e in _events(m)):
                break
        assert got[0].HasField("snapshot")

    run(main)


def _events(message: SubscribeResponse) -> list[KvGroupEvent]:
    return list(message.snapshot.events if message.HasField("snapshot") else message.batch.events)


def test_tls_with_client_certificates(pki: Pki) -> None:
    async def main(engine: FakeEngine, start: Callable[..., Awaitable[Bridge]]) -> None:
        tls = ServerTls(pki.server_cert, pki.server_key, client_ca_file=pki.ca)
        bridge = await start(token=TOKEN, tls=tls)
        target = f"127.0.0.1:{bridge.grpc_port}"
        mutual = channel_credentials(pki.ca, pki.client_cert, pki.client_key)
        ok = await first_message(target, credentials=mutual, metadata=call_metadata(TOKEN))
        assert ok.HasField("snapshot")
        refusals = {
            "plaintext": None,
            "no client certificate": channel_credentials(pki.ca),
            "server signed by an unknown CA": channel_credentials(
                pki.other_ca, pki.client_cert, pki.client_key
            ),
        }
        for what, credentials in refusals.items():
            if credentials is None:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await first_message(target, metadata=call_metadata(TOKEN))
            else:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await first_message(
                        target, credentials=credentials, metadata=call_metadata(TOKEN)
                    )
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, what
        # TLS does not replace the token
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await first_message(target, credentials=mutual)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED

    run(main)


def test_tls_without_client_certificates(pki: Pki) -> None:
    async def main(engine: FakeEngine, start: Callable[..., Awaitable[Bridge]]) -> None:
        bridge = await start(tls=ServerTls(pki.server_cert, pki.server_key))
        target = f"localhost:{bridge.grpc_port}"
        got = await first_message(target, credentials=channel_credentials(pki.ca))
        assert got.HasField("snapshot")
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await first_message(target)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

    run(main)


def test_the_token_comes_from_a_file_never_from_argv(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pki: Pki
) -> None:
    token_file = tmp_path / "token"
    token_file.write_bytes(TOKEN + b"\n")
    base = ["--engine", "tcp://127.0.0.1:5557"]
    config = config_from_args(build_parser().parse_args([*base, "--token-file", str(token_file)]))
    assert config.token == TOKEN and TOKEN.decode() not in repr(config)
    # an environment variable may name the file (not hold the token)
    monkeypatch.setenv("KVROUTE_BRIDGE_TOKEN_FILE", str(token_file))
    assert config_from_args(build_parser().parse_args(base)).token == TOKEN
    monkeypatch.delenv("KVROUTE_BRIDGE_TOKEN_FILE")
    assert config_from_args(build_parser().parse_args(base)).token is None
    with pytest.raises(SystemExit):
        build_parser().parse_args([*base, "--token", TOKEN.decode()])
    for bad, problem in ((b"", "empty"), (b"two words", "printable ASCII")):
        token_file.write_bytes(bad)
        with pytest.raises(ValueError, match=problem):
            config_from_args(build_parser().parse_args([*base, "--token-file", str(token_file)]))
    with pytest.raises(ValueError, match="cannot read"):
        config_from_args(build_parser().parse_args([*base, "--token-file", str(tmp_path / "x")]))
    tls = ["--tls-cert-file", pki.server_cert, "--tls-key-file", pki.server_key]
    config = config_from_args(build_parser().parse_args([*base, *tls]))
    assert config.tls == ServerTls(pki.server_cert, pki.server_key)
    with pytest.raises(ValueError, match="go together"):
        config_from_args(build_parser().parse_args([*base, "--tls-cert-file", pki.server_cert]))
    with pytest.raises(ValueError, match="needs"):
        config_from_args(build_parser().parse_args([*base, "--tls-client-ca-file", pki.ca]))


def test_a_flood_of_subscriptions_is_capped_and_the_engine_still_followed() -> None:
    async def main(engine: FakeEngine, start: Callable[..., Awaitable[Bridge]]) -> None:
        bridge = await start(max_subscribers=3)
        target = f"127.0.0.1:{bridge.grpc_port}"
        await asyncio.sleep(0.3)
        for i in range(200):  # a state worth snapshotting
            await engine.publish([store([10_000 + i], None, [i] * 16)])
        seen: list[SubscribeResponse] = []
        holder = asyncio.ensure_future(_collect(target, seen))
        await eventually(lambda: bool(seen))  # the router already following
        release = asyncio.Event()
        flood = [asyncio.ensure_future(_hold(target, release)) for _ in range(40)]
        await asyncio.sleep(0.2)
        started = asyncio.get_running_loop().time()
        await engine.publish([store([7], None, TOKENS)])
        while not any(be(7) in e.block_hashes for m in seen for e in _events(m)):
            assert asyncio.get_running_loop().time() - started < 2.0, "the engine stalled"
            await asyncio.sleep(0.01)
        await eventually(lambda: sum(f.done() for f in flood) >= 38)
        release.set()
        codes = [await f for f in flood]
        holder.cancel()
        refused = codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED)
        assert refused == 38 and codes.count(None) == 2  # the holder took the third place
        assert rejected(bridge, "over_capacity") == refused
        assert sum(s.subscriber_count for s in bridge.streams.values()) <= 3

    run(main)


async def _collect(target: str, into: list[SubscribeResponse]) -> None:
    async for message in subscribe(target):
        into.append(message)


async def _hold(target: str, release: asyncio.Event) -> grpc.StatusCode | None:
    """Subscribe and hold the stream until `release`; the refusal's code, or None if served."""
    seen: list[SubscribeResponse] = []
    task = asyncio.ensure_future(_collect_raw(target, seen))
    while not task.done() and not seen:
        await asyncio.sleep(0.01)
    if task.done():
        exc = task.exception()
        assert isinstance(exc, grpc.aio.AioRpcError)
        return exc.code()
    await release.wait()
    task.cancel()
    return None


async def _collect_raw(target: str, into: list[SubscribeResponse]) -> None:
    """One subscription without reconnecting: the refusal raises."""
    async with grpc.aio.insecure_channel(target) as channel:
        method = channel.unary_stream(
            SUBSCRIBE_METHOD,
            request_serializer=SubscribeRequest.SerializeToString,
            response_deserializer=SubscribeResponse.FromString,
        )
        async for message in method(SubscribeRequest(dp_rank=0)):
            into.append(message)
