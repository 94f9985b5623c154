"""Who may call the admin API: a full token (read and change the fleet) and a read-only one.

Each token comes from the config value (an environment variable set from a Secret) or from a
file (a mounted Secret). Tokens are compared in constant time; the read-only token never
passes a route that changes membership.
"""

from __future__ import annotations

import enum
import hmac
from dataclasses import dataclass

from kvroute.bridge.auth import read_secret
from kvroute.router.config import AdminConfig
from kvroute.router.edge.errors import FORBIDDEN, READ_ONLY, UNAUTHORIZED, RouterError


class Scope(enum.Enum):
    READ = "read"  # look at the fleet, decisions, and score a prompt
    WRITE = "write"  # add, remove, drain, undrain, resync workers


@dataclass(frozen=True, slots=True)
class AdminTokens:
    full: bytes | None
    read: bytes | None

    @classmethod
    def from_config(cls, admin: AdminConfig) -> AdminTokens:
        """The configured tokens, files read now; ValueError if a file is unreadable."""
        return cls(
            _one(admin.token, admin.token_file, "admin token"),
            _one(admin.read_token, admin.read_token_file, "admin read token"),
        )

    def authorize(self, header: str, scope: Scope) -> None:
        """Return if the `authorization` header value grants `scope`, else raise RouterError:
        403 when no token is configured, 401 for a missing or unknown token, 403 for the
        read-only token on a write route."""
        if self.full is None and self.read is None:
            raise RouterError(FORBIDDEN, "admin API disabled: set admin.token or admin.read_token")
        kind, _, given = header.partition(" ")
        if kind.lower() != "bearer" or not given:
            raise RouterError(UNAUTHORIZED, "missing or wrong admin bearer token")
        raw = given.encode()
        # both comparisons always run, so the time taken does not tell which token matched
        full = self.full is not None and hmac.compare_digest(raw, self.full)
        read = self.read is not None and hmac.compare_digest(raw, self.read)
        if full:
            return
        if not read:
            raise RouterError(UNAUTHORIZED, "missing or wrong admin bearer token")
        if scope is Scope.WRITE:
            raise RouterError(
                READ_ONLY, "the read-only admin token cannot change the fleet: use admin.token"
            )


def _one(value: str | None, path: str | None, what: str) -> bytes | None:
    if path is not None:
        return read_secret(path, what)
    return value.encode() if value else None
