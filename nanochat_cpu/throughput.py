"""Is the cluster faster than its fastest node would be alone? An estimate from one step's timings.

In the field reports two nodes trained at 57 tok/s and the workstation alone at 60 (FAILURES row
16), and nothing said so. Every rank already measures, per step, how long it computed
(forward+backward of its rows), how long it waited on the wire and how long the step took. From
that, rank 0 models each rank training alone on the same global batch:

    alone_r(T) = T x (compute_r / tokens_r)  +  world x optimizer_r

(the optimizer part is the step minus compute minus waiting; each rank updates 1/world of the
parameters, so alone it would do world times that), and the cluster as

    cluster(T) = T x (slowest compute / T)  +  fixed    (fixed = the step minus the slowest compute:
                                                         the wire, the sharded optimizer)

The wire's bytes per step are set by the model, not by T, so a larger global batch always helps
a cluster on a slow link: the break-even T is where the two lines cross.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class RankTiming:
    host: str
    tokens: int  # tokens this rank computed in the step
    compute_s: float  # its forward+backward passes
    wait_s: float  # blocked in collectives
    step_s: float  # the whole step, as this rank saw it


@dataclass
class Estimate:
    cluster_tok_per_s: float
    alone_tok_per_s: list[float]  # each rank alone at the same global batch (estimated)
    fastest: int  # the rank that would be fastest alone
    break_even_tokens: int | None  # global batch from which the cluster wins; None: never at this split

    @property
    def vs_fastest(self) -> float:
        return self.cluster_tok_per_s / self.alone_tok_per_s[self.fastest]


def optimizer_alone_s(t: RankTiming, world: int) -> float:
    return world * max(0.0, t.step_s - t.compute_s - t.wait_s)


def estimate(timings: list[RankTiming], total_tokens: int) -> Estimate:
    world = len(timings)
    step_s = max(t.step_s for t in timings)
    alone = [total_tokens / (total_tokens * t.compute_s / t.tokens + optimizer_alone_s(t, world)) for t in timings]
    fastest = max(range(world), key=alone.__getitem__)
    slowest_compute = max(t.compute_s for t in timings)
    cluster_per_token = slowest_compute / total_tokens
    fixed = step_s - slowest_compute
    f = timings[fastest]
    alone_per_token = f.compute_s / f.tokens
    alone_fixed = optimizer_alone_s(f, world)
    if alone_per_token <= cluster_per_token:
        break_even = None  # the slowest rank computes its share slower than the fastest does everything
    else:
        break_even = max(0, math.ceil((fixed - alone_fixed) / (alone_per_token - cluster_per_token)))
    return Estimate(total_tokens / step_s, alone, fastest, break_even)


def round_up(tokens: int, unit: int) -> int:
    return -(-tokens // unit) * unit


def verdict(est: Estimate, timings: list[RankTiming], total_tokens: int, unit: int) -> tuple[bool, str]:
    """(slower than the fastest node alone?, one log line that says so and what to change)."""
    f = timings[est.fastest]
    head = (f"cluster {est.cluster_tok_per_s:,.0f} tok/s with {len(timings)} ranks = {est.vs_fastest:.2f}x what "
            f"rank {est.fastest}@{f.host} would do alone (~{est.alone_tok_per_s[est.fastest]:,.0f} tok/s, est.)")
    if est.vs_fastest >= 1:
        return False, head
    compute = max(t.compute_s for t in timings)
    wait = max(t.wait_s for t in timings)
    fixes = []
    if est.break_even_tokens is not None:
        fixes.append(f"--total-batch-size >= {round_up(max(est.break_even_tokens, total_tokens + 1), unit):,} "
                     f"(break-even at this split; now {total_tokens:,})")
    fixes.append("--grad-comm-dtype bfloat16 --param-comm-dtype bfloat16 (half the bytes)")
    quickest = min(t.compute_s for t in timings)
    if compute > 1.2 * quickest:
        fixes.append(f"--rank-batch-sizes auto or per-host rows (compute per step is uneven: {quickest:.2f}-"
                     f"{compute:.2f} s)")
    fixes.append("or leave the host on the slowest link or CPU out")
    return True, (f"SLOWER THAN ONE NODE: {head}. Per step the slowest rank computes {compute:.2f} s and a rank "
                  f"waits up to {wait:.2f} s in collectives. Fix: " + "; ".join(fixes))
