"""Random event streams for property tests: a loose imitation of vLLM's stores (dense
full attention, sparse sliding-window tails, Mamba states and partial entries) mixed
with the awkward cases (gaps, stale and duplicate batches, clears, INVALID, kind
changes, unknown parents, unmatchable and namespaced blocks, snapshots)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from kvroute.proto import events_pb2 as pb
from tests.indexer.events import (
    FULL,
    MAMBA,
    SWA,
    block_hashes,
    clear,
    engine_hashes,
    invalid,
    remove,
    store,
)

# (kind, block size, window) per group
LAYOUTS: list[list[tuple[str, int, int]]] = [
    [(FULL, 16, 0)],
    [(FULL, 32, 0)],
    [(FULL, 16, 0), (SWA, 16, 32), (MAMBA, 16, 0)],
    [(FULL, 16, 0), (SWA, 16, 48), (MAMBA, 64, 0)],  # partial hits: alignment 16
    [(FULL, 32, 0), (MAMBA, 64, 0)],  # partial hits at 32 (entries of 32 tokens)
    [(FULL, 64, 0), (MAMBA, 128, 0), (FULL, 32, 0)],  # fine full unit with partials
    [(FULL, 16, 0), (FULL, 16, 0), (MAMBA, 32, 0)],  # a two-group unit
    [(FULL, 16, 0), (SWA, 32, 64)],  # LCM 32
    [(FULL, 16, 0), (SWA, 16, 1)],  # window 1
    [(MAMBA, 16, 0)],  # sparse only: nothing ever resolves
    [(SWA, 16, 32)],
    [("mla_attention", 16, 0), ("sliding_window_mla", 16, 40)],
    [(FULL, 64, 0), (MAMBA, 96, 0)],  # one fine full unit: partial entries extend it
    [(FULL, 16, 0), ("chunked_local_attention", 16, 0)],  # not modelled: None
]

NAMESPACES = [("", ""), ("", ""), ("", ""), ("lora-a", ""), ("", "salt-1"), ("lora-a", "s2")]


@dataclass
class Request:
    tokens: list[int]
    ns: tuple[str, str]


@dataclass
class WorkerStream:
    """Generates one worker's actions."""

    rng: random.Random
    layout: list[tuple[str, int, int]]
    group_ids: list[int]
    docs: list[list[int]]
    clean: bool = False  # no contradicting evidence (kind changes, mismatched parents)
    seq: int = 0
    sent: list[pb.KvEventBatch] = field(default_factory=list)
    stores: list[pb.KvGroupEvent] = field(default_factory=list)
    copies: list[tuple[int, bytes]] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list)

    @property
    def engine_unit(self) -> int:
        return math.gcd(*(bs for _, bs, _ in self.layout))

    def request(self) -> Request:
        rng = self.rng
        if self.requests and rng.random() < 0.4:
            base = rng.choice(self.requests)
            cut = rng.randrange(0, len(base.tokens) + 1)
            tokens = base.tokens[:cut] + [rng.randrange(7, 10) for _ in range(rng.randrange(0, 60))]
            ns = base.ns if rng.random() < 0.8 else rng.choice(NAMESPACES)
        else:
            doc = rng.choice(self.docs)
            tokens = doc[: rng.randrange(1, len(doc) + 1)]
            tokens += [rng.randrange(7, 10) for _ in range(rng.randrange(0, 40))]
            ns = rng.choice(NAMESPACES)
        return Request(tokens, ns)

    def _store_events(self, req: Request) -> list[pb.KvGroupEvent]:
        rng = self.rng
        tokens, (lora, salt) = req.tokens, req.ns
        eu = self.engine_unit
        fine = engine_hashes(tokens, eu, lora, salt)
        n = len(tokens)
        lcm = math.lcm(*(bs for _, bs, _ in self.layout))
        cached = rng.randrange(0, n // lcm + 1) * lcm if rng.random() < 0.4 else 0
        unmatchable = rng.random() < 0.05
        events: list[pb.KvGroupEvent] = []
        for (kind, bs, window), gid in zip(self.layout, self.group_ids, strict=True):
            hashes = block_hashes(fine, bs, eu)
            start, end = cached // bs, n // bs
            if start > end:
                continue
            span = tokens[start * bs : end * bs]
            parent = hashes[start - 1] if start > 0 else b""
            if rng.random() < 0.05 and parent:
                parent = rng.randbytes(8)  # a parent nobody reported
            elif rng.random() < 0.05 and parent and (lora or salt) and not self.clean:
                # a child naming a namespace its parent (the default one) does not have
                plain = block_hashes(engine_hashes(tokens, eu), bs, eu)
                parent = plain[start - 1]
            chosen = hashes[start:end]
            if kind in (SWA, "sliding_window_mla", MAMBA):
                mode = rng.random()
                if kind == MAMBA and mode < 0.6:
                    chosen = chosen[-1:]
                elif mode < 0.6:
                    need = max(1, -(-(window - 1) // bs))
                    chosen = chosen[-need:]
                elif mode < 0.75:
                    chosen = []
                elif mode < 0.85:
                    chosen = [h for h in chosen if rng.random() < 0.5]
            common = dict(
                window=window,
                lora=lora,
                salt=salt if not parent else "",
                unmatchable=unmatchable,
            )
            events.append(store(gid, chosen, span, bs, kind, parent=parent, **common))  # type: ignore[arg-type]
            # partial entries at the prompt's last engine-unit boundary inside a block
            if bs > eu and kind in (FULL, MAMBA, "mla_attention") and rng.random() < 0.6:
                p = ((n - 1) // eu) * eu
                if p % bs and p > 0:
                    i = p // eu - 1
                    par = fine[i - 1] if i > 0 else b""
                    events.append(
                        store(
                            gid,
                            [fine[i]],
                            tokens[p - eu : p],
                            eu,
                            kind,
                            parent=par,
                            window=window,
                            lora=lora,
                            salt=salt if not par else "",
                            unmatchable=unmatchable,
                        )
                    )
        rng.shuffle(events) if rng.random() < 0.3 else None
        return events

    def next_actions(self) -> list[tuple[str, object]]:
        """One step: usually a batch; sometimes a snapshot, invalidation or override."""
        rng = self.rng
        r = rng.random()
        events: list[pb.KvGroupEvent] = []
        if r < 0.55:
            req = self.request()
            self.requests.append(req)
            events = self._store_events(req)
            for e in events:
                self.stores.append(e)
                self.copies.extend((e.group_id, h) for h in e.block_hashes)
            if rng.random() < 0.15 and len(events) > 1:  # split across two batches
                cut = rng.randrange(1, len(events))
                return [("batch", self._batch(events[:cut])), ("batch", self._batch(events[cut:]))]
        elif r < 0.75:
            for _ in range(rng.randrange(1, 6)):
                if self.copies and rng.random() < 0.9:
                    gid, h = self.copies.pop(rng.randrange(len(self.copies)))
                else:
                    gid, h = rng.choice(self.group_ids), rng.randbytes(8)
                events.append(remove(gid, [h]))
        elif r < 0.8 and self.stores:
            if rng.random() < 0.5:
                events = [rng.choice(self.stores) for _ in range(rng.randrange(1, 3))]  # duplicates
            else:  # evict a whole store's blocks, as vLLM evicts a finished request's chain
                victim = rng.choice(self.stores)
                for h in victim.block_hashes:
                    events.append(remove(victim.group_id, [h]))
                    if (victim.group_id, h) in self.copies:
                        self.copies.remove((victim.group_id, h))
        elif r < 0.83:
            events = [clear()]
            self.copies.clear()
        elif r < 0.85:
            events = [invalid()]
        elif r < 0.87 and not self.clean:
            gid = rng.choice(self.group_ids)
            events = [store(gid, [], [], 16, rng.choice([FULL, SWA, MAMBA]), window=32)]
        elif r < 0.9:
            self.seq += rng.randrange(1, 3)  # a gap
            return [("batch", self._batch([]))]
        elif r < 0.92 and self.sent:
            return [("batch", rng.choice(self.sent))]  # stale
        elif r < 0.95 and self.stores:
            picked = [e for e in self.stores if rng.random() < 0.5]
            # Position-only lineage: past stores (dense ones place blocks, others are no-ops).
            lineage = [e for e in self.stores if rng.random() < 0.3]
            has_seq = rng.random() < 0.5
            snap = pb.Snapshot(
                sequence=self.seq,
                has_sequence=has_seq,
                events=picked,
                lineage=lineage,
                stream_id="x",
            )
            if has_seq:
                self.seq += 1
            return [("snapshot", snap)]
        elif r < 0.96:
            return [("invalidate", None)]
        elif r < 0.98:
            return [("align", rng.choice([None, None, 16, 32, 48, 64]))]
        return [("batch", self._batch(events))]

    def _batch(self, events: list[pb.KvGroupEvent]) -> pb.KvEventBatch:
        b = pb.KvEventBatch(sequence=self.seq, timestamp=0.0, events=events)
        self.seq += 1
        self.sent.append(b)
        return b

    def probes(self, count: int) -> list[Request]:
        rng = self.rng
        out = []
        for _ in range(count):
            if self.requests and rng.random() < 0.7:
                base = rng.choice(self.requests)
                r = rng.random()
                if r < 0.4:
                    tokens = list(base.tokens)
                elif r < 0.7:
                    tokens = base.tokens[: rng.randrange(0, len(base.tokens) + 1)]
                else:
                    tail = [rng.randrange(7, 10) for _ in range(rng.randrange(1, 50))]
                    tokens = base.tokens + tail
                ns = base.ns if rng.random() < 0.85 else rng.choice(NAMESPACES)
                out.append(Request(tokens, ns))
            else:
                out.append(self.request())
        return out


def make_stream(
    rng: random.Random, layout_index: int | None = None, clean: bool = False
) -> WorkerStream:
    layout = LAYOUTS[rng.randrange(len(LAYOUTS)) if layout_index is None else layout_index]
    gids = list(range(len(layout)))
    rng.shuffle(gids)
    if rng.random() < 0.3:
        gids = [g * 3 + 1 for g in gids]
    vocab = rng.randrange(2, 6)
    docs = [[rng.randrange(vocab) for _ in range(rng.randrange(40, 260))] for _ in range(3)]
    return WorkerStream(rng, layout, gids, docs, clean)
