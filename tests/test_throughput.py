"""The cluster-vs-one-node estimate (nanochat_cpu.throughput), on timings measured on the
container cluster (cluster/scaling_bench.py, depth 4, 3,072 tokens a step, 0.6 CPU per node)."""

from __future__ import annotations

import pytest

from nanochat_cpu.throughput import RankTiming, estimate, verdict

TOKENS = 3072
UNIT = 6 * 256  # rows per micro-step x seq


def three_nodes(wait_s: float, step_s: float, compute_s: float = 0.523) -> list[RankTiming]:
    return [RankTiming(f"node{r}", TOKENS // 3, compute_s, wait_s, step_s) for r in range(3)]


def test_slow_link_is_called_out_with_the_break_even_batch():
    # 100 Mbit/s, even CPUs: measured 602 tok/s; node0 alone measured 1,967 tok/s
    timings = three_nodes(wait_s=4.532, step_s=5.106)
    est = estimate(timings, TOKENS)
    assert est.cluster_tok_per_s == pytest.approx(602, abs=1)
    assert est.alone_tok_per_s[est.fastest] == pytest.approx(1784, rel=0.01)  # within 10% of measured
    assert est.vs_fastest == pytest.approx(0.34, abs=0.01)
    # cluster 3072 x a + 4.583 s = alone 3072 x c + 0.153 s  ->  T = 4.430 / (c - a)
    assert est.break_even_tokens == pytest.approx(13_010, rel=0.01)
    slower, line = verdict(est, timings, TOKENS, UNIT)
    assert slower
    assert line.startswith("SLOWER THAN ONE NODE: cluster 602 tok/s with 3 ranks = 0.34x what rank 0@node0")
    assert "--total-batch-size >= 13,824 (break-even at this split; now 3,072)" in line
    assert "--param-comm-dtype bfloat16" in line
    assert "--rank-batch-sizes" not in line  # the ranks computed alike
    # already bf16 on the wire: no fix that is in place already
    assert "--param-comm-dtype" not in verdict(est, timings, TOKENS, UNIT, halvable=False)[1]


def test_fast_link_is_reported_as_a_gain():
    # unlimited link, even CPUs: measured 4,455 tok/s = 2.26x node0 alone
    timings = three_nodes(wait_s=0.101, step_s=0.690, compute_s=0.522)
    est = estimate(timings, TOKENS)
    assert est.vs_fastest == pytest.approx(2.56, abs=0.01)  # a rank computes a bit slower inside the cluster
    assert est.break_even_tokens == 0  # the cluster wins at any batch
    slower, line = verdict(est, timings, TOKENS, UNIT)
    assert not slower and line.startswith("FASTER THAN ONE NODE: cluster 4,452 tok/s with 3 ranks = 2.56x what rank 0")


def test_a_slow_rank_on_an_even_split_can_never_break_even():
    # one node at a quarter of the fast node's speed, the same rows for both: the cluster's compute
    # per token (bound by the slow rank) is worse than the fast node doing everything alone
    timings = [RankTiming("workstation", 1536, 0.40, 1.30, 1.80), RankTiming("laptop", 1536, 1.60, 0.05, 1.80)]
    est = estimate(timings, TOKENS)
    assert est.fastest == "workstation" and est.break_even_tokens is None
    slower, line = verdict(est, timings, TOKENS, UNIT)
    assert slower and "rank 0@workstation" in line
    assert "break-even" not in line
    assert "--rank-batch-sizes auto or per-host rows (compute per step is uneven: 0.40-1.60 s)" in line


def test_ranks_sharing_a_host_are_compared_with_that_host_as_one_process():
    # bench, depth 4 with nanochat's vocabulary: 2 processes on one 2-core machine, each computing
    # 512 tokens in 0.575 s, optimizer 0.084 s, step 0.662 s; one process measured 1,656 tok/s.
    # Comparing with one rank alone (its one thread) claimed 1.9x; the machine alone is the truth.
    timings = [RankTiming("vm", 512, 0.575, 0.002, 0.662), RankTiming("vm", 512, 0.575, 0.002, 0.662)]
    est = estimate(timings, 1024)
    assert est.alone_tok_per_s["vm"] == pytest.approx(1024 / (0.575 + 0.085), rel=0.01)
    assert est.vs_fastest == pytest.approx(1.0, abs=0.01)
    _, line = verdict(est, timings, 1024, 1024)
    assert "with 2 ranks = 1.00x what ranks 0+1@vm would do alone as one process (~1,552 tok/s, est.)" in line


def test_local_steps_name_the_batch_that_shrinks_each_nodes_optimizer():
    # depth 8, 10 Mbit/s, H = 4, 12,288 tokens a step (BENCHMARKS 2026-12-03 third): rank 0's
    # means over the phase of steps 9-12, its outer sync included (dt 26.5, 26.8, 24.9, 136.2 s)
    tokens, unit = 12_288, 3 * 2 * 256
    timings = [RankTiming(f"node{r}", tokens // 3, c, w, 53.600)
               for r, (c, w) in enumerate(((20.451, 27.376), (20.253, 27.480), (20.100, 27.729)))]
    est = estimate(timings, tokens, local_steps=True)
    slower, line = verdict(est, timings, tokens, unit, local_steps=True)
    assert not slower
    # node1's optimizer is the largest share of its own work: 5.867 / (20.253 + 5.867)
    assert ("To gain more: each node runs its optimizer on the whole model every inner step: 5.87 s to its "
            "20.25 s of compute (22% of its work) on 4,096 tokens; --total-batch-size 36,864 gives each node the "
            "12,288 tokens the cluster steps on now (optimizer ~9%") in line
    # synchronous steps share the optimizer out (ZeRO-2): no such hint
    assert "To gain more" not in verdict(est, timings, tokens, unit)[1]


def test_a_node_whose_optimizer_is_a_small_share_gets_no_hint():
    # 1.4 s of optimizer to 16.7 s of compute: 8% of the node's work, under the 10% worth a line
    timings = [RankTiming(f"node{r}", 4096, 16.7, 1.0, 19.1) for r in range(3)]
    est = estimate(timings, 12_288, local_steps=True)
    assert "To gain more" not in verdict(est, timings, 12_288, 1536, local_steps=True)[1]
