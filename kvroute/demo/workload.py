"""The demo's built-in setup: fleet shape and workload, full and short.

The workload is the bench's generator (:mod:`kvroute.testbed.workload`) with a demo-sized spec:
multi-turn chats that share a system prompt per tenant, coding-agent sessions whose context
grows with tool output each turn, half the tenants with their own ``cache_salt``, and one
hot-prefix burst. Same seed, same trace.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvroute.testbed.textgen import TokenSpace
from kvroute.testbed.trace import TraceRequest
from kvroute.testbed.workload import AgentSpec, BurstSpec, ChatSpec, WorkloadSpec, generate


@dataclass(frozen=True)
class DemoSetup:
    """Everything a demo run is made of, besides the policy."""

    name: str
    profile: str  # sim model profile (kvroute/sim/profiles.py)
    workers: int  # mixed engines
    speed: float  # sim GPU speed factor (1.0 = the modelled H100)
    prefill_tokens_per_s: float  # what the router is told about one worker's prefill rate
    workload: WorkloadSpec
    prefill: int = 0  # engines that only prefill (a prefill/decode fleet)...
    decode: int = 0  # ...and engines that only decode

    @property
    def pd(self) -> bool:
        """Whether the fleet is split into prefill and decode pools."""
        return self.prefill > 0

    @property
    def engines(self) -> int:
        return self.workers + self.prefill + self.decode


# The sim's step model prefills ~28k tokens/s on the modelled H100 for these prompt lengths.
_H100_PREFILL_TOKENS_PER_S = 28_000.0

# Engines run at a fifth of the modelled H100: prefill then weighs as it does for a larger
# model, which is where cache hits pay off; and the replay stays light enough for 2 cores.
_SPEED = 0.2

FULL = DemoSetup(
    name="full",
    profile="swa",
    workers=4,
    speed=_SPEED,
    prefill_tokens_per_s=_H100_PREFILL_TOKENS_PER_S * _SPEED,
    workload=WorkloadSpec(
        seed=7,
        duration_s=15.0,
        tenants=4,
        salted_fraction=0.5,
        chat=ChatSpec(
            sessions=24,
            turns=(3, 6),
            system_tokens=(800, 2000),
            user_tokens=(30, 200),
            answer_tokens=(20, 60),
            think_time_s=1.5,
        ),
        agent=AgentSpec(
            sessions=6,
            tool_schema_tokens=2000,
            instructions_tokens=(300, 800),
            task_tokens=(40, 200),
            turns=(6, 14),
            tool_call_tokens=(20, 60),
            tool_output_tokens=(200, 1500),
            tool_time_s=0.4,
            max_context_tokens=7500,
        ),
        burst=BurstSpec(
            bursts=1,
            size=8,
            prefix_tokens=(1500, 3000),
            question_tokens=(10, 40),
            window_s=1.0,
            answer_tokens=(10, 30),
        ),
    ),
)

# For CI: two engines and a few seconds of traffic, same shapes.
SHORT = DemoSetup(
    name="short",
    profile=FULL.profile,
    workers=2,
    speed=_SPEED,
    prefill_tokens_per_s=FULL.prefill_tokens_per_s,
    workload=WorkloadSpec(
        seed=7,
        duration_s=3.0,
        tenants=2,
        salted_fraction=0.5,
        chat=ChatSpec(
            sessions=6,
            turns=(2, 4),
            system_tokens=(400, 800),
            user_tokens=(20, 80),
            answer_tokens=(8, 20),
            think_time_s=0.3,
        ),
        agent=AgentSpec(
            sessions=2,
            tool_schema_tokens=800,
            instructions_tokens=(100, 300),
            task_tokens=(20, 60),
            turns=(3, 5),
            tool_call_tokens=(10, 30),
            tool_output_tokens=(100, 500),
            tool_time_s=0.1,
            max_context_tokens=4000,
        ),
        burst=BurstSpec(bursts=0),
    ),
)

# `kvroute demo --pd`: the same workloads on two prefill and two decode engines.
PD = replace(FULL, name="pd-full", workers=0, prefill=2, decode=2)
PD_SHORT = replace(SHORT, name="pd-short", workers=0, prefill=2, decode=2)

SETUPS = {s.name: s for s in (FULL, SHORT, PD, PD_SHORT)}


def demo_trace(setup: DemoSetup, model: str) -> list[TraceRequest]:
    """The setup's trace with every request naming ``model``."""
    return generate(replace(setup.workload, model=model), TokenSpace.discover())
