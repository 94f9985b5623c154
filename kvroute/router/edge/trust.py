"""Which peers may tell the router (and through it the engines) who the client is: their
X-Forwarded-* and Forwarded headers pass; anyone else's are dropped at the edge."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_networks(entries: Iterable[str]) -> list[Network]:
    """Each entry an address or CIDR range; ValueError names the first that is neither."""
    out: list[Network] = []
    for entry in entries:
        try:
            out.append(ipaddress.ip_network(entry.strip(), strict=False))
        except ValueError:
            raise ValueError(f"not an IP address or CIDR range: {entry!r}") from None
    return out


class TrustedPeers:
    """Membership test of a peer address in the configured networks (none: nobody)."""

    def __init__(self, entries: Iterable[str]) -> None:
        self._networks = parse_networks(entries)

    def __contains__(self, peer: str | None) -> bool:
        if not self._networks or not peer:
            return False
        try:
            addr = ipaddress.ip_address(peer)
        except ValueError:
            return False
        return any(addr in net for net in self._networks)


def peer_of(scope: object) -> str | None:
    """The client address of an ASGI scope, if the server gave one."""
    client = scope.get("client") if isinstance(scope, dict) else None
    return client[0] if client else None
