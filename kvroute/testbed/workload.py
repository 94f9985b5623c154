"""Seeded generator of request traces (kvroute JSONL, see :mod:`kvroute.testbed.trace`).

Four workloads, mixed in one trace:

- **chat**: many users in multi-turn conversations. Each tenant has its own system prompt,
  shared by all its users. Every turn resends the whole history: the system prompt, the
  previous user messages and the assistant's previous answers, plus a new user message.
  Users think between turns.
- **agent**: coding-agent sessions shaped like public agent traces: a large system prompt
  with tool schemas (the schemas shared by every tenant's agent, the instructions per
  tenant), a task, then many turns that each append a short assistant tool call and a tool
  output of a few hundred to a few thousand tokens. Little think time (tool execution).
  Tool output is sent as a ``user`` message so every chat template and router accepts it.
- **tenants**: every session belongs to a tenant (Zipf-distributed popularity); a fraction
  of tenants send a distinct ``cache_salt``, which must keep their caches apart.
- **burst**: hot-prefix bursts: many single-turn requests within a short window that share a
  long new document (a prefix nobody holds yet) and ask different questions.

The assistant answers in the history are synthetic text of the turn's ``max_tokens``
length. ``t`` of a later turn is the previous turn's ``t`` plus the think time, so a replay
in open loop sends it at ``max(t, previous answer + think time)``.

Same spec and seed give the same trace byte for byte (given the same tokenizer).
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from kvroute.testbed.textgen import TokenSpace
from kvroute.testbed.trace import (
    TraceHeader,
    TraceRequest,
    from_mooncake,
    read_mooncake,
    write_jsonl,
)

IntRange = tuple[int, int]


@dataclass(frozen=True)
class ChatSpec:
    sessions: int = 48
    turns: IntRange = (2, 8)
    system_tokens: IntRange = (400, 1600)  # per tenant
    user_tokens: IntRange = (20, 300)
    answer_tokens: IntRange = (40, 200)
    think_time_s: float = 3.0  # mean of an exponential
    # a conversation ends early rather than outgrow the engines' context (prompt + answer)
    max_context_tokens: int = 1_000_000_000


@dataclass(frozen=True)
class AgentSpec:
    sessions: int = 8
    tool_schema_tokens: int = 2500  # shared by every tenant's agent
    instructions_tokens: IntRange = (500, 1500)  # per tenant
    task_tokens: IntRange = (40, 400)
    turns: IntRange = (8, 30)
    tool_call_tokens: IntRange = (20, 120)
    tool_output_tokens: IntRange = (200, 2500)  # log-uniform
    tool_time_s: float = 0.8  # mean of an exponential
    # The simulated engines' default max_model_len is 8192; prompt + answer must fit.
    max_context_tokens: int = 7500


@dataclass(frozen=True)
class BurstSpec:
    bursts: int = 2
    size: int = 12
    prefix_tokens: IntRange = (1500, 4000)
    question_tokens: IntRange = (15, 80)
    window_s: float = 1.5
    answer_tokens: IntRange = (20, 80)


@dataclass(frozen=True)
class WorkloadSpec:
    """Everything that determines a trace, besides the token space."""

    seed: int = 0
    duration_s: float = 40.0  # window in which sessions start
    tenants: int = 8
    salted_fraction: float = 0.5
    tenant_zipf: float = 1.1
    model: str | None = None
    chat: ChatSpec = field(default_factory=ChatSpec)
    agent: AgentSpec = field(default_factory=AgentSpec)
    burst: BurstSpec = field(default_factory=BurstSpec)


PRESETS: dict[str, WorkloadSpec] = {
    "default": WorkloadSpec(),
    # Seconds to replay on a small fleet: used by --smoke benchmarks and tests.
    "smoke": WorkloadSpec(
        duration_s=4.0,
        tenants=3,
        chat=ChatSpec(
            sessions=10,
            turns=(2, 4),
            system_tokens=(300, 600),
            user_tokens=(20, 80),
            answer_tokens=(8, 24),
            think_time_s=0.2,
        ),
        agent=AgentSpec(
            sessions=2,
            tool_schema_tokens=600,
            instructions_tokens=(100, 200),
            turns=(3, 5),
            tool_call_tokens=(10, 30),
            tool_output_tokens=(100, 400),
            tool_time_s=0.1,
            max_context_tokens=4000,
        ),
        burst=BurstSpec(
            bursts=1,
            size=4,
            prefix_tokens=(400, 800),
            question_tokens=(10, 30),
            window_s=0.5,
            answer_tokens=(8, 16),
        ),
    ),
    # Many long conversations and nothing else, for closed-loop clients on pools that hold about
    # half of what the live conversations need (``bench.routing_bench --workload pool-pressure``):
    # 96 conversations of 10-16 turns that grow to about 5,000 tokens (the engines' 8,192-token
    # context caps them), four tenants' system prompts shared, no salts.
    "pool-pressure": WorkloadSpec(
        duration_s=60.0,
        tenants=4,
        salted_fraction=0.0,
        chat=ChatSpec(
            sessions=96,
            turns=(10, 16),
            system_tokens=(300, 800),
            user_tokens=(150, 400),
            answer_tokens=(30, 80),
            think_time_s=1.0,
            max_context_tokens=7600,
        ),
        agent=AgentSpec(sessions=0),
        burst=BurstSpec(bursts=0),
    ),
}


def _uniform_int(rng: random.Random, r: IntRange) -> int:
    return rng.randint(min(r), max(r))


def _log_uniform_int(rng: random.Random, r: IntRange) -> int:
    lo, hi = max(1, min(r)), max(1, max(r))
    return round(math.exp(rng.uniform(math.log(lo), math.log(hi))))


def _zipf_choice(rng: random.Random, n: int, s: float) -> int:
    weights = [1.0 / (k + 1) ** s for k in range(n)]
    return rng.choices(range(n), weights=weights)[0]


@dataclass(frozen=True)
class Tenant:
    index: int
    name: str
    cache_salt: str | None
    system_tokens: int
    agent_instruction_tokens: int


def make_tenants(spec: WorkloadSpec) -> list[Tenant]:
    """The spec's tenants; the first ``salted_fraction`` of them send a cache_salt."""
    rng = random.Random(f"{spec.seed}/tenants")
    n_salted = round(spec.tenants * spec.salted_fraction)
    return [
        Tenant(
            index=i,
            name=f"tenant-{i:02d}",
            cache_salt=f"salt-tenant-{i:02d}" if i < n_salted else None,
            system_tokens=_uniform_int(rng, spec.chat.system_tokens),
            agent_instruction_tokens=_uniform_int(rng, spec.agent.instructions_tokens),
        )
        for i in range(spec.tenants)
    ]


class _Builder:
    """Turns session plans into TraceRequests (holds the token space and the spec)."""

    def __init__(self, spec: WorkloadSpec, space: TokenSpace) -> None:
        self.spec = spec
        self.space = space
        self.tenants = make_tenants(spec)

    def _tenant(self, rng: random.Random) -> Tenant:
        return self.tenants[_zipf_choice(rng, len(self.tenants), self.spec.tenant_zipf)]

    def _request(
        self,
        *,
        session: str,
        turn: int,
        kind: str,
        t: float,
        think: float,
        tenant: Tenant,
        messages: list[dict[str, str]],
        max_tokens: int,
        prompt_tokens: int,
    ) -> TraceRequest:
        return TraceRequest(
            id=f"{session}-t{turn:02d}",
            t=round(t, 4),
            session=session,
            turn=turn,
            kind=kind,
            model=self.spec.model,
            messages=[dict(m) for m in messages],
            max_tokens=max_tokens,
            cache_salt=tenant.cache_salt,
            think_time=round(think, 4),
            user=f"{tenant.name}/{session}",
            prompt_tokens=prompt_tokens,
        )

    def chat(self, i: int) -> list[TraceRequest]:
        c = self.spec.chat
        rng = random.Random(f"{self.spec.seed}/chat/{i}")
        tenant = self._tenant(rng)
        session = f"chat-{i:04d}"
        t = rng.uniform(0.0, self.spec.duration_s)
        system = self.space.content(("chat-system", tenant.index), tenant.system_tokens)
        messages = [{"role": "system", "content": system}]
        n_tokens = tenant.system_tokens
        out: list[TraceRequest] = []
        for turn in range(_uniform_int(rng, c.turns)):
            think = 0.0 if turn == 0 else rng.expovariate(1.0 / c.think_time_s)
            t += think
            n_user = _uniform_int(rng, c.user_tokens)
            n_answer = _uniform_int(rng, c.answer_tokens)
            # The chat template adds a few tokens per message; keep room for them.
            if n_tokens + n_user + n_answer + 8 * (len(messages) + 1) > c.max_context_tokens:
                break
            messages.append(
                {"role": "user", "content": self.space.content((session, turn, "user"), n_user)}
            )
            n_tokens += n_user
            out.append(
                self._request(
                    session=session,
                    turn=turn,
                    kind="chat",
                    t=t,
                    think=think,
                    tenant=tenant,
                    messages=messages,
                    max_tokens=n_answer,
                    prompt_tokens=n_tokens,
                )
            )
            answer = self.space.content((session, turn, "assistant"), n_answer)
            messages.append({"role": "assistant", "content": answer})
            n_tokens += n_answer
        return out

    def agent(self, i: int) -> list[TraceRequest]:
        a = self.spec.agent
        rng = random.Random(f"{self.spec.seed}/agent/{i}")
        tenant = self._tenant(rng)
        session = f"agent-{i:04d}"
        t = rng.uniform(0.0, self.spec.duration_s)
        system = self.space.content(
            ("agent-instructions", tenant.index), tenant.agent_instruction_tokens
        ) + self.space.text(("agent-tool-schemas",), a.tool_schema_tokens)
        n_task = _uniform_int(rng, a.task_tokens)
        messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": self.space.content((session, "task"), n_task)},
        ]
        n_tokens = tenant.agent_instruction_tokens + a.tool_schema_tokens + n_task
        out: list[TraceRequest] = []
        for turn in range(_uniform_int(rng, a.turns)):
            n_call = _uniform_int(rng, a.tool_call_tokens)
            # The chat template adds a few tokens per message; keep room for them.
            if n_tokens + n_call + 8 * len(messages) > a.max_context_tokens:
                break
            think = 0.0 if turn == 0 else rng.expovariate(1.0 / a.tool_time_s)
            t += think
            out.append(
                self._request(
                    session=session,
                    turn=turn,
                    kind="agent",
                    t=t,
                    think=think,
                    tenant=tenant,
                    messages=messages,
                    max_tokens=n_call,
                    prompt_tokens=n_tokens,
                )
            )
            call = self.space.content((session, turn, "call"), n_call)
            n_output = _log_uniform_int(rng, a.tool_output_tokens)
            output = self.space.content((session, turn, "tool-output"), n_output)
            messages.append({"role": "assistant", "content": call})
            messages.append({"role": "user", "content": output})
            n_tokens += n_call + n_output
        return out

    def burst(self, b: int) -> list[TraceRequest]:
        bs = self.spec.burst
        rng = random.Random(f"{self.spec.seed}/burst/{b}")
        t0 = rng.uniform(0.0, self.spec.duration_s)
        n_doc = _uniform_int(rng, bs.prefix_tokens)
        doc = self.space.content(("burst-doc", self.spec.seed, b), n_doc)
        tenant = self._tenant(rng)
        out = []
        for k in range(bs.size):
            session = f"burst-{b:02d}-{k:03d}"
            n_q = _uniform_int(rng, bs.question_tokens)
            question = self.space.text((session, "question"), n_q)
            messages = [{"role": "user", "content": doc + question}]
            out.append(
                self._request(
                    session=session,
                    turn=0,
                    kind="burst",
                    t=t0 + rng.uniform(0.0, bs.window_s),
                    think=0.0,
                    tenant=tenant,
                    messages=messages,
                    max_tokens=_uniform_int(rng, bs.answer_tokens),
                    prompt_tokens=n_doc + n_q,
                )
            )
        return out


def generate(spec: WorkloadSpec, space: TokenSpace) -> list[TraceRequest]:
    """The trace for ``spec``, sorted by send time."""
    b = _Builder(spec, space)
    out: list[TraceRequest] = []
    for i in range(spec.chat.sessions):
        out.extend(b.chat(i))
    for i in range(spec.agent.sessions):
        out.extend(b.agent(i))
    for i in range(spec.burst.bursts):
        out.extend(b.burst(i))
    out.sort(key=lambda r: (r.t, r.session, r.turn))
    return out


def live_working_set_tokens(requests: Sequence[TraceRequest], clients: int) -> float:
    """The prompt tokens that ``clients`` closed-loop clients' live conversations hold at a
    time, on average: ``clients`` times the mean, over conversations, of a conversation's
    prompt length averaged over its turns (each turn taken to last as long as any other)."""
    turns: dict[str, list[int]] = {}
    for r in requests:
        turns.setdefault(r.session, []).append(r.prompt_tokens)
    if not turns or clients <= 0:
        return 0.0
    per_conversation = [sum(ts) / len(ts) for ts in turns.values()]
    live = min(clients, len(per_conversation))
    return live * sum(per_conversation) / len(per_conversation)


def spec_params(spec: WorkloadSpec) -> dict[str, Any]:
    return asdict(spec)


def describe(requests: Sequence[TraceRequest]) -> dict[str, Any]:
    """Counts and token totals per kind (for logs and reports)."""
    kinds: dict[str, dict[str, int]] = {}
    for r in requests:
        k = kinds.setdefault(r.kind, {"requests": 0, "sessions": 0, "prompt_tokens": 0})
        k["requests"] += 1
        k["prompt_tokens"] += r.prompt_tokens
        if r.turn == 0:
            k["sessions"] += 1
    return {
        "requests": len(requests),
        "prompt_tokens": sum(r.prompt_tokens for r in requests),
        "span_s": round(max((r.t for r in requests), default=0.0), 3),
        "kinds": kinds,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m kvroute.testbed.workload",
        description="Write a kvroute JSONL trace from a preset workload or a Mooncake trace.",
    )
    p.add_argument("--out", required=True, help="output JSONL path")
    p.add_argument("--preset", choices=sorted(PRESETS), default="default")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--duration", type=float, default=None, help="session start window (s)")
    p.add_argument("--model", default=None, help="model name to put in every request")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json or model directory")
    p.add_argument("--mooncake", default=None, help="convert this Mooncake trace instead")
    p.add_argument("--time-scale", type=float, default=1.0, help="Mooncake: speed-up factor")
    p.add_argument("--max-output-tokens", type=int, default=None, help="Mooncake: output cap")
    args = p.parse_args(argv)

    space = TokenSpace.discover(args.tokenizer)
    if args.mooncake:
        reqs = from_mooncake(
            read_mooncake(args.mooncake),
            space,
            model=args.model,
            time_scale=args.time_scale,
            max_output_tokens=args.max_output_tokens,
        )
        header = TraceHeader("mooncake", None, {"source": args.mooncake, "words": space.source})
    else:
        spec = PRESETS[args.preset]
        if args.seed is not None:
            spec = replace(spec, seed=args.seed)
        if args.duration is not None:
            spec = replace(spec, duration_s=args.duration)
        if args.model is not None:
            spec = replace(spec, model=args.model)
        reqs = generate(spec, space)
        header = TraceHeader(
            f"kvroute.testbed.workload:{args.preset}",
            spec.seed,
            {**spec_params(spec), "words": space.source},
        )
    n = write_jsonl(args.out, reqs, header)
    print(f"wrote {n} requests to {args.out}: {describe(reqs)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
