"""Traffic for the recording: seeded random workloads and the recorders that probe vLLM.

Runs only in the vLLM environment (imported by vllm_scenarios.py and vllm_driver.py).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm_wire import ServedPublisher, WireCapture

from kvroute.sim.vllm_backend import Namespace, SchedulerLoop


@dataclass
class Workload:
    """Seeded random traffic: shared prefixes, multi-turn growth, namespaces, resets."""

    requests: int = 40
    concurrency: int = 3
    prefixes: int = 4
    prefix_len: tuple[int, int] = (8, 160)
    user_len: tuple[int, int] = (1, 120)
    output_len: tuple[int, int] = (1, 40)
    max_history: int = 480
    namespaces: tuple[Namespace, ...] = (Namespace(),)
    reset_probability: float = 0.0
    probe_every: int = 6
    probes_per_point: int = 10


@dataclass
class Recorder:
    """Runs one scenario: backend + publisher (with capture) + probes."""

    loop: SchedulerLoop
    capture: WireCapture | ServedPublisher
    rng: random.Random
    probes: list[dict[str, Any]] = field(default_factory=list)

    def probe(
        self,
        tokens: list[int],
        namespace: Namespace | None = None,
        label: str = "",
        expect: int | None = None,
        prompt_logprobs: int | None = None,
    ) -> int:
        ns = namespace or Namespace()
        answer = self.loop.backend.native_hit(tokens, ns, prompt_logprobs=prompt_logprobs)
        self.probes.append(
            {
                "after": self.capture.published,
                "tokens": list(tokens),
                "lora_name": ns.lora_name,
                "cache_salt": ns.cache_salt,
                "hit": answer.hit,
                "per_group": list(answer.per_group),
                "label": label,
                "expect": expect,
                "prompt_logprobs": prompt_logprobs is not None,
            }
        )
        return answer.hit

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(1, 32000) for _ in range(n)]

    def run(
        self,
        tokens: list[int],
        outputs: int = 1,
        namespace: Namespace | None = None,
        report_mode: str | None = None,
    ) -> list[int]:
        """Run one request to completion; returns prompt + generated tokens."""
        out = self.tokens(outputs)
        self.loop.run_request(tokens, out, namespace, report_mode=report_mode)
        return list(tokens) + out


class FleetLoop:
    """Several workers behind one submit/step interface: each request goes to `replicas`
    workers chosen at random (like a router spreading load), and all workers step together."""

    def __init__(self, loops: dict[str, SchedulerLoop], rng: random.Random, replicas: int):
        self.loops = loops
        self.rng = rng
        self.replicas = replicas

    @property
    def idle(self) -> bool:
        return all(loop.idle for loop in self.loops.values())

    def submit(
        self,
        tokens: list[int],
        outputs: list[int],
        namespace: Namespace | None = None,
        *,
        on_finish: Callable[[Any], None] | None = None,
    ) -> None:
        fired: list[bool] = []

        def once(request: Any) -> None:
            if not fired and on_finish is not None:
                fired.append(True)
                on_finish(request)

        for worker in self.rng.sample(sorted(self.loops), self.replicas):
            self.loops[worker].submit(tokens, outputs, namespace, on_finish=once)

    def step(self) -> bool:
        progressed = False
        for name, loop in self.loops.items():
            if not loop.idle:
                if not loop.step():
                    raise RuntimeError(f"worker {name} cannot make progress")
                progressed = True
        return progressed

    def reset_prefix_cache(self) -> None:
        for loop in self.loops.values():
            loop.reset_prefix_cache()


@dataclass
class FleetRecorder:
    """Runs one fleet: a backend and a captured publisher per worker, probes to all of them."""

    name: str
    loop: FleetLoop
    captures: dict[str, WireCapture]
    rng: random.Random
    probes: list[dict[str, Any]] = field(default_factory=list)

    def probe(self, tokens: list[int], namespace: Namespace | None = None, label: str = "") -> None:
        ns = namespace or Namespace()
        answers = {w: loop.backend.native_hit(tokens, ns) for w, loop in self.loop.loops.items()}
        self.probes.append(
            {
                "after": {w: c.published for w, c in self.captures.items()},
                "tokens": list(tokens),
                "lora_name": ns.lora_name,
                "cache_salt": ns.cache_salt,
                "hits": {w: a.hit for w, a in answers.items()},
                "per_group": {w: list(a.per_group) for w, a in answers.items()},
                "label": label,
            }
        )

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(1, 32000) for _ in range(n)]


def run_workload(rec: Recorder | FleetRecorder, w: Workload) -> None:
    rng, loop = rec.rng, rec.loop
    prefixes = [rec.tokens(rng.randint(*w.prefix_len)) for _ in range(w.prefixes)]
    finished: list[tuple[Namespace, list[int], list[int]]] = []  # (ns, prompt, full history)
    in_flight: list[tuple[Namespace, list[int]]] = []
    submitted = 0
    steps = 0

    def new_prompt() -> tuple[Namespace, list[int]]:
        roll = rng.random()
        if finished and roll < 0.45:
            ns, _, history = rng.choice(finished)
            if len(history) < w.max_history:
                return ns, history + rec.tokens(rng.randint(*w.user_len) // 2 + 1)
        if finished and roll < 0.55:
            ns, prompt, _ = rng.choice(finished)
            return ns, list(prompt)  # an exact resend
        ns = rng.choice(w.namespaces)
        head = rng.choice(prefixes) if rng.random() < 0.7 else []
        return ns, head + rec.tokens(rng.randint(*w.user_len))

    def probe_point() -> None:
        candidates: list[tuple[str, Namespace, list[int]]] = []
        for ns, prompt, history in rng.sample(finished, min(len(finished), 3)):
            cut = rng.randint(1, len(history))
            candidates += [
                ("history", ns, history),
                ("next-turn", ns, history + rec.tokens(rng.randint(1, 40))),
                ("resend", ns, prompt),
                ("truncated", ns, history[:cut]),
                ("other-namespace", rng.choice(w.namespaces), history),
            ]
            unit = rng.choice([16, 32, 64])
            edge = max(1, (len(history) // unit) * unit + rng.choice([-1, 0, 1]))
            candidates.append(("boundary", ns, history[:edge]))
        for ns, prompt in in_flight[:2]:
            candidates.append(("in-flight", ns, prompt))
        head = rng.choice(prefixes)
        candidates += [
            ("prefix+new", rng.choice(w.namespaces), head + rec.tokens(rng.randint(1, 80))),
            ("unrelated", Namespace(), rec.tokens(rng.randint(1, 200))),
        ]
        rng.shuffle(candidates)
        for label, ns, tokens in candidates[: w.probes_per_point]:
            if tokens:
                rec.probe(tokens, ns, label)

    draining = False  # stop admitting until idle, then reset the prefix cache
    while submitted < w.requests or not loop.idle:
        active = len(in_flight)
        if draining and loop.idle:
            draining = False
            loop.reset_prefix_cache()
            probe_point()
        while (
            not draining
            and submitted < w.requests
            and active < w.concurrency
            and rng.random() < 0.6
        ):
            ns, prompt = new_prompt()
            outputs = rec.tokens(rng.randint(*w.output_len))
            entry = (ns, prompt)
            in_flight.append(entry)

            def done(
                request: Any,
                ns: Namespace = ns,
                prompt: list[int] = prompt,
                entry: tuple[Namespace, list[int]] = entry,
            ) -> None:
                in_flight.remove(entry)
                history = list(request.prompt_token_ids) + list(request.output_token_ids)
                finished.append((ns, prompt, history))

            loop.submit(prompt, outputs, ns, on_finish=done)
            submitted += 1
            active += 1
        if loop.idle:
            continue
        if not loop.step():
            raise RuntimeError("the workload does not fit the pool")
        steps += 1
        if steps % w.probe_every == 0:
            probe_point()
        if not draining and rng.random() < w.reset_probability / w.probe_every:
            draining = True
    probe_point()
