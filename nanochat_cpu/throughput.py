"""Is the cluster faster than its fastest node would be alone? An estimate from one step's timings.

In the field reports two nodes trained at 57 tok/s and the workstation alone at 60
(docs/FAILURES.md row 16), and nothing said so. Every rank already measures, per step, how long it computed
(forward+backward of its rows), how long it waited on the wire and how long the step took. From
that, rank 0 models each rank training alone on the same global batch:

    alone_r(T) = T x (compute_r / tokens_r)  +  world x optimizer_r

(the optimizer part is the step minus compute minus waiting; each rank updates 1/world of the
parameters, so alone it would do world times that; with local steps each node updates the
whole model already, its ranks sharing the work). A node is a host: ranks that share one (2
processes on a machine) are modelled as that machine alone running one process on all their
cores, their compute rates added up and the optimizer's world shares spread over them (perfect
thread scaling: an optimistic "alone", so the verdict errs towards calling the cluster slower).
The cluster is modelled as

    cluster(T) = T x (slowest compute / T)  +  fixed    (fixed = the step minus the slowest compute:
                                                         the wire, the sharded optimizer)

The wire's bytes per step are set by the model, not by T, so a larger global batch always helps
a cluster on a slow link: the break-even T is where the two lines cross.

With local steps a node runs its optimizer on the whole model every inner step, for its share of
the batch, where alone it would run it once for all of it. On a slow link, once auto's H has made
the wire a small share, that is much of what is left (10 Mbit/s, depth 8: 22% of a node's inner
step; docs/TRAINER.md, "Is the cluster faster than one node?"), and the lever is more tokens per
node per inner step: `local_optimizer_hint` names the batch.
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
    alone_tok_per_s: dict[str, float]  # each host alone at the same global batch (estimated)
    fastest: str  # the host that would be fastest alone
    break_even_tokens: int | None  # global batch from which the cluster wins; None: never at this split

    @property
    def vs_fastest(self) -> float:
        return self.cluster_tok_per_s / self.alone_tok_per_s[self.fastest]


def optimizer_alone_s(t: RankTiming, shards: int) -> float:
    return shards * max(0.0, t.step_s - t.compute_s - t.wait_s)


def host_alone(ranks: list[RankTiming], shards: int) -> tuple[float, float]:
    """(seconds per token, seconds per step) of one host training alone, from its ranks' timings;
    each rank updated 1/shards of the parameters."""
    per_token = 1 / sum(t.tokens / max(t.compute_s, 1e-9) for t in ranks)
    return per_token, sum(optimizer_alone_s(t, shards) for t in ranks) / len(ranks) ** 2


def estimate(timings: list[RankTiming], total_tokens: int, local_steps: bool = False) -> Estimate:
    world = len(timings)
    step_s = max(t.step_s for t in timings)
    by_host: dict[str, list[RankTiming]] = {}
    for t in timings:
        by_host.setdefault(t.host, []).append(t)
    lines = {host: host_alone(ranks, len(ranks) if local_steps else world) for host, ranks in by_host.items()}
    alone = {host: total_tokens / (total_tokens * per_token + fixed) for host, (per_token, fixed) in lines.items()}
    fastest = max(alone, key=alone.__getitem__)
    slowest_compute = max(t.compute_s for t in timings)
    cluster_per_token = slowest_compute / total_tokens
    fixed = step_s - slowest_compute
    alone_per_token, alone_fixed = lines[fastest]
    if alone_per_token <= cluster_per_token:
        break_even = None  # the slowest rank computes its share slower than the fastest does everything
    else:
        break_even = max(0, math.ceil((fixed - alone_fixed) / (alone_per_token - cluster_per_token)))
    return Estimate(total_tokens / step_s, alone, fastest, break_even)


LOCAL_OPTIMIZER_SHARE = 0.1  # with local steps: a node's optimizer share of its own work worth a hint


def local_optimizer_hint(timings: list[RankTiming], total_tokens: int, unit: int) -> str | None:
    """With local steps: where a node's optimizer is a large share of its work (compute + optimizer,
    the wire left out: auto's H keeps that small), the batch that gives each node the tokens the
    whole cluster steps on now, as one node alone would (the optimizer's cost does not grow with
    the tokens, the compute does)."""
    nodes = len({t.host for t in timings})
    worst = max(timings, key=lambda t: optimizer_alone_s(t, 1) / max(t.compute_s + optimizer_alone_s(t, 1), 1e-9))
    opt = optimizer_alone_s(worst, 1)
    share = opt / max(worst.compute_s + opt, 1e-9)
    if nodes < 2 or share < LOCAL_OPTIMIZER_SHARE:
        return None
    after = opt / (nodes * worst.compute_s + opt)
    wider = round_up(nodes * total_tokens, unit)
    return (f"each node runs its optimizer on the whole model every inner step: {opt:.2f} s to its "
            f"{worst.compute_s:.2f} s of compute ({share:.0%} of its work) on {worst.tokens:,} tokens; "
            f"--total-batch-size {wider:,} gives each node the {total_tokens:,} tokens the cluster steps on now "
            f"(optimizer ~{after:.0%}; fewer, larger steps: see docs/TRAINER.md for what that costs in val bpb)")


def round_up(tokens: int, unit: int) -> int:
    return -(-tokens // unit) * unit


def verdict(est: Estimate, timings: list[RankTiming], total_tokens: int, unit: int,
            local_steps: bool = False, halvable: bool = True) -> tuple[bool, str]:
    """(slower than the fastest node alone?, one log line that says so and what to change).
    `halvable`: something still travels in fp32, so bf16 on the wire would halve its bytes."""
    ranks = [r for r, t in enumerate(timings) if t.host == est.fastest]
    who = (f"rank {ranks[0]}@{est.fastest} would do alone" if len(ranks) == 1 else
           f"ranks {'+'.join(map(str, ranks))}@{est.fastest} would do alone as one process")
    head = (f"cluster {est.cluster_tok_per_s:,.0f} tok/s with {len(timings)} ranks = {est.vs_fastest:.2f}x what "
            f"{who} (~{est.alone_tok_per_s[est.fastest]:,.0f} tok/s, est.)")
    hint = local_optimizer_hint(timings, total_tokens, unit) if local_steps else None
    if est.vs_fastest >= 1:
        return False, f"FASTER THAN ONE NODE: {head}" + (f". To gain more: {hint}" if hint else "")
    compute = max(t.compute_s for t in timings)
    wait = max(t.wait_s for t in timings)
    fixes = []
    if not local_steps:
        fixes.append("--sync-every auto (each node trains alone between outer syncs: the wire's bytes once "
                     "per many steps)")
    if est.break_even_tokens is not None:
        fixes.append(f"--total-batch-size >= {round_up(max(est.break_even_tokens, total_tokens + 1), unit):,} "
                     f"(break-even at this split; now {total_tokens:,})")
    if halvable:
        fixes.append("--grad-comm-dtype bfloat16 --param-comm-dtype bfloat16 (half the bytes)")
    quickest = min(t.compute_s for t in timings)
    if compute > 1.2 * quickest:
        fixes.append(f"--rank-batch-sizes auto or per-host rows (compute per step is uneven: {quickest:.2f}-"
                     f"{compute:.2f} s)")
    if hint:
        fixes.append(hint)
    fixes.append("or leave the host on the slowest link or CPU out")
    return True, (f"SLOWER THAN ONE NODE: {head}. Per step the slowest rank computes {compute:.2f} s and a rank "
                  f"waits up to {wait:.2f} s in collectives. Fix: " + "; ".join(fixes))
