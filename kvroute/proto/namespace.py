"""The tenant namespace on the wire: a one-way digest of a request's `cache_salt`.

vLLM mixes `cache_salt` into the hash of a request's first block, so one tenant's cache never
serves another's. A router only needs to tell the namespaces apart, so the bridge publishes
`salt_namespace(salt)` (never the salt itself) and the router computes the same digest from
the salt of each request it routes. Both sides must use this one function.
"""

from __future__ import annotations

import hashlib
from typing import Final

# Versioned personalisation: a change of digest is a new namespace scheme, never a collision
# with the old one (old and new simply do not match, which only lowers predicted hits).
_PERSON: Final = b"kvroute.ns.v1"


def salt_namespace(cache_salt: str) -> str:
    """The namespace digest of `cache_salt` (32 hex digits; "" for no salt)."""
    if not cache_salt:
        return ""
    digest = hashlib.blake2b(cache_salt.encode("utf-8"), digest_size=16, person=_PERSON)
    return digest.hexdigest()
