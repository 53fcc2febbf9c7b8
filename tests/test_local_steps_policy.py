"""Local steps' policy, no processes: when the nodes meet (OuterSchedule), what auto chooses and
why (H, the warm-up's end, overlapped or blocking, where a sync lands), what a resume keeps, and
the timings those choices are made from. The runs on real torchrun launchers are test_local_steps.py."""

from __future__ import annotations

import threading

import pytest
import torch

from nanochat_cpu.config import parse_config, sync_warmup_steps
from nanochat_cpu.local_steps import auto_on_resume, overlap_asked, overlap_work_s
from nanochat_cpu.outer_policy import (
    AUTO_FIRST_PHASE,
    AUTO_MAX_H,
    OuterSchedule,
    choose_overlap,
    choose_sync_every,
    first_outer_phase,
    keep_synchronous,
    landing_steps,
    warm_up_end,
)
from nanochat_cpu.progress import PhaseTimes
from nanochat_cpu.run_state import SavedSchedule
from nanochat_cpu.sync_diloco import DiLoCo, Nodes, OuterStats


def test_schedule_of_a_synchronous_run_is_every_step():
    s = OuterSchedule(1, 1, 100)
    assert all(s.boundary(step) for step in range(1, 101))
    assert [step for step in range(1, 101) if s.due(25, step)] == [25, 50, 75, 100]
    assert not any(s.due(0, step) for step in range(1, 101))


def test_schedule_defers_what_falls_inside_an_inner_phase_to_its_boundary():
    s = OuterSchedule(2, 8, 30)  # auto's first phase of 2, then H = 8; the last phase is short
    assert [step for step in range(1, 31) if s.boundary(step)] == [2, 10, 18, 26, 30]
    assert [step for step in range(1, 31) if s.boundary(step) and s.due(5, step)] == [10, 18, 26, 30]
    assert OuterSchedule(2, None, 30).boundary(2) and not OuterSchedule(2, None, 30).boundary(10)


def test_schedule_after_a_synchronous_warm_up_counts_from_its_end():
    s = OuterSchedule(3 + 2, 2, 12, start=3)  # steps 1-3 synchronous (checkpointed at 3), then H = 2
    assert [step for step in range(4, 13) if s.boundary(step)] == [5, 7, 9, 11, 12]
    assert s.previous(5) == 3 and s.previous(9) == 7
    assert not s.due(3, 5)  # step 3's checkpoint was the warm-up's: not taken again at 5
    assert s.due(3, 7)  # step 6 fell in the phase 5-7


def test_auto_stays_synchronous_only_where_its_steps_wait_at_most_five_percent():
    keep, why = keep_synchronous(0.031)
    assert keep and "waited 3.1% of their time on the wire" in why and "every step stays synchronous" in why
    assert keep_synchronous(0.05)[0]
    keep, why = keep_synchronous(0.2)
    assert not keep and "over 5%: local steps follow" in why
    keep, why = keep_synchronous(None)
    assert not keep and "no synchronous step was timed" in why


def test_auto_holds_the_warm_up_waits_to_five_percent_of_the_run():
    end, why = warm_up_end(wire_s=0.5, local_step_s=1.0, num_iterations=1000, planned=50, step=3)
    assert end == 50 and "keeps its 50 steps" in why and "buys 100" in why  # a fast link: the planned warm-up
    # 10 Mbit/s at depth 8 (docs/BENCHMARKS.md): each synchronous step waits ~110 s, a local one takes ~30 s
    end, why = warm_up_end(wire_s=110.0, local_step_s=30.0, num_iterations=1000, planned=50, step=3)
    assert end == 13 and 13 * 110.0 <= 0.05 * 1000 * 30.0 < 14 * 110.0
    assert why == ("the synchronous warm-up ends at step 13 instead of 50 (each synchronous step waits 110.00 s on "
                   "the wire, and 5% of the run's ~8.3h (1000 steps of ~30.00 s once local) buys 13)")
    assert warm_up_end(wire_s=100.0, local_step_s=1.0, num_iterations=100, planned=5, step=3)[0] == 3  # not before now


def test_an_outer_step_weighs_a_node_by_the_rows_it_did_when_the_split_changed_mid_phase():
    nodes = Nodes(index=0, ranks=[[0], [1]], group=None, leaders=None, rank=0)
    diloco = DiLoCo(torch.nn.Linear(4, 4), nodes, 0.5, 1.0, 0.0, torch.float32, torch.float32, shared_params=False)
    # 8 rows a step: [2, 2] in 2 micro-steps, then re-split to [5, 3] in one
    for sizes, accum in (([2, 2], 2), ([2, 2], 2), ([5, 3], 1), ([5, 3], 1)):
        diloco.count(sizes, accum)
    assert diloco.phase_share() == 18 / 32  # not 5/8, the split it ends at
    for _ in range(7):
        diloco.count([1, 2], 4)
    assert diloco.phase_share() == 1 / 3  # a phase at one split: exactly node_token_share's
    assert diloco.phase_share() == 0.5  # nothing counted: the share it was built with


def test_a_phase_re_split_midway_spreads_its_outer_sync_over_all_its_steps():
    """H = 8, new splits after steps 2 and 3: the timing line's compute and the steps' own waits are
    the last split's alone, but the outer sync (4 s at the phase's last step) is a cost of all 8
    steps, not of the 5 timed."""
    phase = PhaseTimes()
    for _ in range(2):
        phase.add(2.0, 0.0, 2.0)
    phase = phase.restarted()  # two re-splits in one phase: the steps before both count
    phase.add(2.0, 0.0, 2.0)
    phase = phase.restarted()
    for sync in (0.0, 0.0, 0.0, 0.0, 4.0):  # each step also waits 0.1 s inside its node
        phase.add(1.0, 0.1 + sync, 1.1 + sync, sync)
    assert phase.per_step() == pytest.approx((1.0, 0.6, 1.6))
    whole = PhaseTimes()
    for sync in (0.0,) * 7 + (4.0,):
        whole.add(1.0, 0.1 + sync, 1.1 + sync, sync)
    assert whole.per_step() == pytest.approx((1.0, 0.6, 1.6))  # as a phase that kept one split
    # a timing window across phases (local steps): a sync before the re-split still counts
    window = PhaseTimes()
    for sync in (0.0, 4.0):  # the last two steps of the phase before, its sync
        window.add(1.0, 0.1 + sync, 1.1 + sync, sync)
    window = window.restarted()
    for sync in (0.0,) * 7 + (4.0,):
        window.add(1.0, 0.1 + sync, 1.1 + sync, sync)
    assert window.per_step() == pytest.approx((1.0, 0.1 + 8.0 / 10, 1.1 + 8.0 / 10))


def test_auto_sets_the_first_inner_phase_from_the_warm_ups_wire_wait():
    assert first_outer_phase(wire_s=0.1, work_s=0.5)[0] == 4  # 19 x 0.2 = 3.8
    assert first_outer_phase(wire_s=110.0, work_s=30.0)[0] == 70  # 10 Mbit/s, depth 8
    assert first_outer_phase(wire_s=0.001, work_s=1.0)[0] == AUTO_FIRST_PHASE  # never a lone first step
    assert first_outer_phase(wire_s=500.0, work_s=1.0)[0] == AUTO_MAX_H
    # two ranks a node: a synchronous step sent both ranks' slices, an outer sync sends one node's
    assert first_outer_phase(wire_s=220.0, work_s=30.0, ranks_per_node=2)[0] == 70
    # overlapped: the steps a sync takes to cross (1.5x its time), where blocking would need 19x
    assert first_outer_phase(wire_s=110.0, work_s=30.0, overlap=True)[0] == 6
    assert first_outer_phase(wire_s=0.1, work_s=0.5, overlap=True)[0] == AUTO_FIRST_PHASE
    # --outer-overlap auto: overlapped only where the blocking H would be capped
    assert first_outer_phase(wire_s=110.0, work_s=30.0, overlap=None)[0] == 70
    assert first_outer_phase(wire_s=300.0, work_s=30.0, overlap=None)[0] == 15  # 1.5 x 10, where blocking needs 190
    # a codec's outer sync sending 0.133 of a synchronous step's bytes a value
    h, why = first_outer_phase(wire_s=300.0, work_s=30.0, overlap=None, bytes_ratio=0.133)
    assert h == 26 and "times 0.13 (--outer-compress" in why, why  # 19 x 300 x 0.133 / 30 = 25.3: blocking


def test_an_outer_sync_sends_the_codecs_bytes_per_value_over_a_synchronous_steps():
    from nanochat_cpu.config import TrainConfig
    from nanochat_cpu.local_steps import outer_bytes_ratio

    bf16 = {"grad_comm_dtype": "bfloat16", "param_comm_dtype": "bfloat16"}
    assert outer_bytes_ratio(TrainConfig(**bf16)) == 1.0
    assert outer_bytes_ratio(TrainConfig(outer_compress="int8", **bf16)) == pytest.approx(2.03 / 4, abs=1e-3)
    assert outer_bytes_ratio(TrainConfig(outer_compress="int4")) == pytest.approx(1.125 / 8, abs=1e-3)  # fp32 wire


def test_a_resume_keeps_autos_warm_up_end_unless_the_restart_asks_for_a_shorter_warm_up():
    choice = {"synchronous": False, "why": "measured", "warm_until": 13, "asked_until": 50}
    found = (8, [{8: {"auto_choice": choice}}])  # a checkpoint at step 8, inside auto's shortened warm-up

    def resumed_end(ratio: float) -> int:
        cfg = parse_config(["--num-iterations", "1000", "--sync-every", "auto", "--sync-warmup-ratio", str(ratio)])
        return auto_on_resume(cfg, None, found, sync_warmup_steps(cfg))[1]

    assert resumed_end(0.05) == 13  # the ratio the run was started with: auto's end stands
    assert resumed_end(0.2) == 13  # a longer warm-up asked for: auto's cap still holds
    assert resumed_end(0.01) == 10  # a shorter one: the restart's own
    assert auto_on_resume(parse_config(["--sync-warmup-ratio", "0.01"]), None,  # a marker from before the cap
                          (8, [{8: {"auto_choice": {"synchronous": False, "why": "measured"}}}]), 10)[1] == 10


def test_auto_keeps_the_sync_under_five_percent_and_says_when_capped():
    h, why = choose_sync_every(sync_s=2.0, step_s=4.0)
    assert h == 10 and 2.0 / (h * 4.0 + 2.0) <= 0.05 and "needs H >= 9.5" in why
    assert choose_sync_every(0.001, 4.0)[0] == 1
    h, why = choose_sync_every(sync_s=100.0, step_s=1.0)
    assert h == AUTO_MAX_H and "capped" in why and "of the wall time is the sync" in why


def test_auto_overlapped_needs_the_steps_a_sync_crosses_in_and_holds_its_own_work_to_five_percent():
    """Overlapped, a sync costs no wait where it has landed before the next leaves: it is given 1.5x
    its time (the steps slow while it crosses), and H is at least that; what the node does itself
    at a boundary is held to 5% instead."""
    h, why = choose_sync_every(sync_s=4.5, step_s=2.0, work_s=0.05)
    assert h == 4 and "overlapped, it crosses in 4 inner steps" in why  # 1.5 * 4.5 / 2, where blocking needs 43
    assert choose_sync_every(sync_s=4.5, step_s=2.0)[0] == 43
    h, why = choose_sync_every(sync_s=1.0, step_s=2.0, work_s=1.0)
    assert h == 10 and "at most 5% at H >= 9.5" in why  # the node's own work sets it
    assert choose_sync_every(sync_s=0.01, step_s=2.0, work_s=0.0)[0] == AUTO_FIRST_PHASE
    h, why = choose_sync_every(sync_s=300.0, step_s=1.0, work_s=10.0)
    assert h == AUTO_MAX_H and "capped" in why


def test_outer_overlap_auto_overlaps_only_where_a_blocking_sync_cannot_be_held_to_five_percent():
    overlap, why = choose_overlap(sync_s=1.0, step_s=1.0, work_s=0.1, every=None)
    assert not overlap and "at most 5% of the wall time from H >= 19.0: blocking" in why  # the demo's kind of link
    # 10 Mbit/s at depth 4: blocking is capped at 100 and waits 17%; overlapped, H = 32 (the steps it crosses in)
    overlap, why = choose_overlap(sync_s=25.0, step_s=1.2, work_s=0.5, every=None)
    assert overlap and "is 17% of the wall time at H = 100 (auto's cap)" in why and "1% at H = 32: overlapped" in why
    # the thread's CPU counted: overlapped still waits less than blocking's 17%, until its own work is more
    assert choose_overlap(sync_s=25.0, step_s=1.2, work_s=20.0, every=None)[0]
    assert not choose_overlap(sync_s=25.0, step_s=1.2, work_s=30.0, every=None)[0]
    # an H asked for: blocking where it holds the sync to 5% there, overlapped where not
    assert not choose_overlap(sync_s=1.0, step_s=1.0, work_s=0.1, every=30)[0]
    overlap, why = choose_overlap(sync_s=1.0, step_s=1.0, work_s=0.1, every=8)
    assert overlap and "is 11% of the wall time at H = 8" in why
    # a sync longer than the phase is waited for at the next boundary even overlapped
    overlap, why = choose_overlap(sync_s=10.0, step_s=1.0, work_s=0.1, every=2)
    assert overlap and "and 8.00 s still crossing at the next boundary is 80% at H = 2" in why


def test_a_resumed_run_keeps_what_outer_overlap_auto_chose_and_chooses_anew_where_it_was_told():
    nodes = Nodes(0, [[0], [1]], None, None, 0, background=object())  # a CPU run with on or auto
    on, auto = (parse_config(["--sync-every", "auto", "--outer-overlap", mode]) for mode in ("on", "auto"))
    assert overlap_asked(on, nodes) is True and overlap_asked(on, nodes, SavedSchedule(2, 8, overlap=False)) is True
    assert overlap_asked(auto, nodes) is None  # decided at the first outer sync
    assert overlap_asked(auto, nodes, SavedSchedule(2, 8, overlap=True)) is True  # auto chose before the checkpoint
    assert overlap_asked(auto, nodes, SavedSchedule(2, 8, overlap=False)) is False
    # a checkpoint of a run told on or off (or from before auto existed): auto times the next sync
    assert overlap_asked(auto, nodes, SavedSchedule(2, 8, land_after=3)) is None
    assert overlap_asked(auto, nodes, SavedSchedule(2, 8)) is None
    nodes.background = None  # off, or CUDA: no group for the syncs to cross on
    assert overlap_asked(auto, nodes, SavedSchedule(2, 8, overlap=True)) is False


def test_an_overlapped_syncs_own_work_counts_the_cpu_its_thread_takes_from_the_inner_steps():
    sync = OuterStats(sync_s=3.0, wait_s=2.8, pseudo_grad_norm=0.0, sent_bytes=0, slowest_step_s=1.0, cpu_s=0.3)
    assert overlap_work_s(sync, compute_rate=0.5) == pytest.approx(0.6)  # a 0.5-CPU node: 0.3 s of CPU
    assert overlap_work_s(sync, compute_rate=2.0) == pytest.approx(0.2)  # two cores: the loop's part
    assert overlap_work_s(sync, compute_rate=0.0) == pytest.approx(0.2)


def test_a_stop_counts_the_overlapped_sync_in_flight_and_its_own_blocking_one():
    """StopBudget's estimate: a blocking boundary step's time holds its sync; overlapped, a stop
    waits for the sync in flight, then blocks on its own."""
    diloco = DiLoCo(torch.nn.Linear(4, 4), Nodes(0, [[0], [1]], None, None, 0), 0.5, 1.0, 0.0, torch.float32,
                    torch.float32, shared_params=False)
    diloco.crossing_s = 110.0  # 10 Mbit/s at depth 8
    assert diloco.stop_s() == 0.0  # its sync blocked: the boundary step's time holds it
    diloco.flight = threading.Thread(target=lambda: None)  # it left in the background
    assert diloco.stop_s() == 220.0


def test_an_overlapped_sync_lands_after_the_steps_it_needs_and_at_the_latest_at_the_next_boundary():
    assert landing_steps(sync_s=4.5, step_s=2.0, every=32)[0] == 4
    assert landing_steps(sync_s=0.01, step_s=2.0, every=32)[0] == 1
    steps, why = landing_steps(sync_s=40.0, step_s=2.0, every=16)
    assert steps == 16 and "lands at the next boundary (H = 16)" in why
