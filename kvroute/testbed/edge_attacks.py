"""Resource-exhaustion attacks on a running router, over raw loopback sockets, and the
measures that show it survives them: slow uploads, streams nobody reads, connections that
never finish a request, large bodies at once, and a fresh request's answer time while they
last. Shared by the edge tests and the benchmarks; each function returns plain numbers."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass


def vm_kib(pid: int, field: str = "VmHWM") -> int:
    """A memory figure of process `pid` from /proc (VmHWM: peak resident set), in KiB."""
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def reset_peak(pid: int) -> None:
    """Start VmHWM again from the current resident set (Linux >= 4.0: write 5 to clear_refs)."""
    with open(f"/proc/{pid}/clear_refs", "w", encoding="ascii") as f:
        f.write("5")


@dataclass(frozen=True)
class Answer:
    status: int  # 0: no answer (connection failed or timed out)
    seconds: float
    retry_after: str | None = None


def post(url: str, body: bytes, timeout_s: float = 10.0) -> Answer:
    """POST a JSON body; the status and how long the answer took (errors are answers too)."""
    started = time.perf_counter()
    req = urllib.request.Request(url, body, {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            resp.read()
            return Answer(resp.status, time.perf_counter() - started)
    except urllib.error.HTTPError as exc:
        exc.read()
        retry = exc.headers.get("retry-after")
        return Answer(exc.code, time.perf_counter() - started, retry)
    except (OSError, TimeoutError):
        return Answer(0, time.perf_counter() - started)


def chat_body(model: str, max_tokens: int = 8, stream: bool = False) -> bytes:
    """A small chat request; a long one (`ignore_eos`) generates all of `max_tokens`."""
    return json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": "hello there"}],
            "max_tokens": max_tokens,
            "stream": stream,
            "ignore_eos": max_tokens > 8,
        }
    ).encode()


def _connect(host: str, port: int, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:  # before connect, so the advertised window stays small
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(10.0)
    sock.connect((host, port))
    return sock


def _head(path: str, length: int, host: str) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        f"content-length: {length}\r\n\r\n"
    ).encode()


@contextlib.contextmanager
def slow_uploads(host: str, port: int, n: int, path: str) -> Iterator[list[socket.socket]]:
    """`n` requests that declare a 1 KiB body and send 10 bytes of it, then nothing."""
    socks = []
    try:
        for _ in range(n):
            sock = _connect(host, port)
            sock.sendall(_head(path, 1024, host) + b'{"model":"')
            socks.append(sock)
        yield socks
    finally:
        for sock in socks:
            sock.close()


@contextlib.contextmanager
def idle_connections(host: str, port: int, n: int) -> Iterator[list[socket.socket]]:
    """`n` connections that send the first line of a request and never finish its head."""
    socks = []
    try:
        for _ in range(n):
            sock = _connect(host, port)
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\n")
            socks.append(sock)
        yield socks
    finally:
        for sock in socks:
            sock.close()


def answered(sock: socket.socket, wait_s: float) -> int:
    """The status a slow upload was answered with within `wait_s` (0: none)."""
    sock.settimeout(wait_s)
    try:
        line = sock.recv(64).split(b"\r\n", 1)[0]
        return int(line.split()[1]) if line.startswith(b"HTTP/1.1") else 0
    except (OSError, ValueError, IndexError):
        return 0


@contextlib.contextmanager
def unread_streams(
    host: str, port: int, n: int, model: str, max_tokens: int
) -> Iterator[list[socket.socket]]:
    """`n` streaming chat requests whose clients never read a byte of the answer."""
    socks = []
    body = chat_body(model, max_tokens, stream=True)
    try:
        for _ in range(n):
            sock = _connect(host, port, rcvbuf=4096)
            sock.sendall(_head("/v1/chat/completions", len(body), host) + body)
            socks.append(sock)
        yield socks
    finally:
        for sock in socks:
            sock.close()


def first_ok_within(url: str, body: bytes, deadline_s: float) -> tuple[Answer, list[Answer]]:
    """Fresh requests, one after another, until one gets 200 or `deadline_s` passes: the last
    answer and every answer (each must itself come quickly: an overload answer is fine)."""
    started = time.perf_counter()
    answers: list[Answer] = []
    while True:
        left = deadline_s - (time.perf_counter() - started)
        answer = post(url, body, timeout_s=max(left, 0.1))
        answers.append(answer)
        if answer.status == 200 or time.perf_counter() - started >= deadline_s:
            return answer, answers
        time.sleep(0.1)


def large_bodies(host: str, port: int, k: int, size: int, model: str) -> list[int]:
    """`k` chat requests of `size` bytes each (a padding field the engine ignores), all but
    their last 64 KiB sent at once before any is finished, so the router holds them
    together; their statuses."""
    pad = size - len(chat_body(model)) - len(',"pad":""')
    body = chat_body(model)[:-1] + b',"pad":"' + b"a" * pad + b'"}'
    cut = len(body) - 65536
    socks = [_connect(host, port) for _ in range(k)]
    head = _head("/v1/chat/completions", len(body), host)
    statuses = [0] * k
    barrier = threading.Barrier(k)

    def one(i: int) -> None:
        sock = socks[i]
        try:
            sock.sendall(head + body[:cut])
            barrier.wait(timeout=30)
            sock.sendall(body[cut:])
        except (OSError, threading.BrokenBarrierError):
            pass
        statuses[i] = answered(sock, 30.0)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(k)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for sock in socks:
        sock.close()
    return statuses
