"""Who may subscribe to a bridge: a shared token in gRPC metadata, and TLS (grpcio's own).

Both sides read their secrets from files (a mounted Kubernetes Secret), never from argv or a
ConfigMap. The subscriber sends `authorization: Bearer <token>`; the bridge compares it in
constant time. TLS: the bridge presents a certificate; with a client CA it also requires one
from every subscriber (mutual TLS).
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import grpc

TOKEN_METADATA: Final = "authorization"
_SCHEME: Final = "Bearer "
TOKEN_FILE_ENV: Final = "KVROUTE_BRIDGE_TOKEN_FILE"  # names the file, never holds the token


def read_secret(path: str, what: str = "token") -> bytes:
    """The secret in `path`, surrounding whitespace removed; ValueError if unreadable or empty."""
    try:
        secret = Path(path).read_bytes().strip()
    except OSError as exc:
        raise ValueError(f"cannot read {what} file {path}: {exc.strerror or exc}") from None
    if not secret:
        raise ValueError(f"{what} file {path} is empty")
    return secret


def read_token(path: str) -> bytes:
    """The subscription token in `path`: printable ASCII without spaces (it travels as gRPC
    metadata); ValueError otherwise."""
    token = read_secret(path)
    if not all(0x21 <= byte <= 0x7E for byte in token):
        raise ValueError(f"token file {path}: the token must be printable ASCII without spaces")
    return token


def _read_pem(path: str) -> bytes:
    return read_secret(path, "PEM")


@dataclass(frozen=True)
class ServerTls:
    """The bridge's certificate and key; `client_ca_file` set = subscribers must present a
    certificate signed by it."""

    cert_file: str
    key_file: str
    client_ca_file: str | None = None


def server_credentials(tls: ServerTls) -> grpc.ServerCredentials:
    """grpcio server credentials for `tls` (ValueError if a file cannot be read)."""
    pair = (_read_pem(tls.key_file), _read_pem(tls.cert_file))
    ca = _read_pem(tls.client_ca_file) if tls.client_ca_file else None
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=bool(ca))


def channel_credentials(
    ca_file: str | None, cert_file: str | None = None, key_file: str | None = None
) -> grpc.ChannelCredentials:
    """grpcio channel credentials: trust `ca_file` (None = the system roots) and present the
    client certificate `cert_file`/`key_file` if given (mutual TLS)."""
    ca = _read_pem(ca_file) if ca_file else None
    if bool(cert_file) != bool(key_file):
        raise ValueError("a client certificate needs both its cert and key files")
    key = _read_pem(key_file) if key_file else None
    cert = _read_pem(cert_file) if cert_file else None
    return grpc.ssl_channel_credentials(ca, key, cert)


def call_metadata(token: bytes | None) -> tuple[tuple[str, str], ...]:
    """The metadata a subscriber sends (none without a token)."""
    if token is None:
        return ()
    return ((TOKEN_METADATA, _SCHEME + token.decode("utf-8")),)


def token_matches(expected: bytes, metadata: Iterable[tuple[str, Any]] | None) -> bool:
    """True if `metadata` carries `expected` as its bearer token (constant-time comparison)."""
    presented = b""
    for key, value in metadata or ():
        if key == TOKEN_METADATA:
            raw = value.encode("utf-8") if isinstance(value, str) else value
            if raw.startswith(_SCHEME.encode()):
                presented = raw[len(_SCHEME) :]
            break
    # compare_digest on equal-type bytes; a missing token compares as b"" (never equal).
    return hmac.compare_digest(presented, expected) and bool(presented)
