"""A throwaway certificate authority for TLS tests, made with the `openssl` command line:
a CA, a server certificate for 127.0.0.1/localhost, a client certificate, and a second CA
that signed neither (for "wrong CA" cases)."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Pki:
    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    other_ca: str


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _ca(directory: Path, name: str) -> None:
    _openssl(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
        "-keyout", f"{name}.key", "-out", f"{name}.pem", "-subj", f"/CN={name}",
        cwd=directory,
    )  # fmt: skip


def _leaf(directory: Path, name: str, ext: str) -> None:
    _openssl(
        "req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key",
        "-out", f"{name}.csr", "-subj", f"/CN={name}",
        cwd=directory,
    )  # fmt: skip
    (directory / f"{name}.ext").write_text(ext)
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", "2", "-out", f"{name}.pem", "-extfile", f"{name}.ext",
        cwd=directory,
    )  # fmt: skip


def make_pki(directory: Path) -> Pki:
    """Write the CA, server and client certificates into `directory`."""
    _ca(directory, "ca")
    _ca(directory, "other-ca")
    _leaf(
        directory,
        "server",
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n",
    )
    _leaf(directory, "client", "extendedKeyUsage=clientAuth\n")
    d = str(directory)
    return Pki(
        ca=f"{d}/ca.pem",
        server_cert=f"{d}/server.pem",
        server_key=f"{d}/server.key",
        client_cert=f"{d}/client.pem",
        client_key=f"{d}/client.key",
        other_ca=f"{d}/other-ca.pem",
    )
