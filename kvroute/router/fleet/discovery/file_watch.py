"""Workers from a YAML/JSON file, re-read when it changes (polling, no extra dependencies).

The file holds either a list of workers or a mapping with a `workers:` list, each entry
like the router config's. A file that cannot be read or parsed changes nothing: the last
good set stays, the error is counted and logged (rate-limited). A missing file counts as
an error too, not as "no workers": Kubernetes ConfigMap volumes and editors replace files
by rename, and a reader between the two steps must not drain the fleet.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass

import yaml

from kvroute.ratelog import RateLimitedLog
from kvroute.router.fleet.discovery.sink import DiscoverySink, DiscoveryStats, SourceView
from kvroute.router.fleet.discovery.spec import WorkerSpec, WorkerSpecError, parse_workers

log = logging.getLogger(__name__)

MAX_FILE_BYTES = 4 << 20  # a worker list far beyond any fleet; bigger files are refused


@dataclass(frozen=True, slots=True)
class _Stamp:
    """What identifies one version of the file without reading it."""

    mtime_ns: int
    ctime_ns: int
    size: int
    inode: int


def load_workers_file(path: str) -> list[WorkerSpec]:
    """Read and validate a workers file. Raises OSError or WorkerSpecError."""
    with open(path, "rb") as f:
        data = f.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise WorkerSpecError(f"file larger than {MAX_FILE_BYTES} bytes")
    try:
        doc = yaml.safe_load(data)
    except yaml.YAMLError as err:
        raise WorkerSpecError(f"not valid YAML/JSON: {err}") from None
    if doc is None:
        return []
    if isinstance(doc, dict):
        extra = set(doc) - {"workers"}
        if extra:
            raise WorkerSpecError(f"unknown keys {sorted(map(str, extra))}")
        doc = doc.get("workers") or []
    return parse_workers(doc)


class FileSource:
    """Polls `path` every `poll_seconds`; announces its workers, drains the ones removed."""

    def __init__(
        self, sink: DiscoverySink, path: str, *, poll_seconds: float = 2.0, max_workers: int = 4096
    ) -> None:
        self.path = path
        self.poll_seconds = poll_seconds
        self.stats = DiscoveryStats(source="file")
        self._view = SourceView(sink, self.stats, max_workers=max_workers)
        self._stamp: _Stamp | None = None
        self._log = RateLimitedLog(log)

    def poll_once(self) -> bool:
        """Re-read the file if it changed since the last poll. Returns True if it was read
        and applied."""
        try:
            st = os.stat(self.path)
        except OSError as err:
            self._error(f"cannot stat: {err}")
            return False
        stamp = _Stamp(st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_ino)
        if stamp == self._stamp:
            return False
        # Remember the stamp even if parsing fails, so a bad file is reported once per
        # version instead of on every poll.
        self._stamp = stamp
        try:
            workers = load_workers_file(self.path)
        except (OSError, WorkerSpecError) as err:
            self._error(str(err))
            return False
        if len(workers) > self._view.max_workers:
            self.stats.rejected += len(workers) - self._view.max_workers
            self._error(f"{len(workers)} workers, only the first {self._view.max_workers} used")
            workers = workers[: self._view.max_workers]
        self._view.replace_all(workers)
        return True

    async def run(self) -> None:
        """Poll until cancelled."""
        while True:
            self.poll_once()
            await asyncio.sleep(self.poll_seconds)

    def stop(self) -> None:
        """Drain every worker this source announced."""
        self._view.clear()

    def _error(self, message: str) -> None:
        self.stats.errors += 1
        self._log.warning(message, "discovery file %s: %s", self.path, message)
