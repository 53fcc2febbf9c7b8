"""cluster/scaling_bench.py's --sync-every axis: the steps each H runs and the window it measures,
on made-up rank 0 output (the bench itself needs the container cluster)."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster.scaling_bench import (
    Result,
    collect,
    last_step_logged,
    measured_window,
    step_tokens,
    steps_for,
    sync_every_value,
    whole_periods_logged,
    window_means,
)

PREFIX = "[node0 rank 0/3] "


def step_line(step: int, total: int, dt_ms: int) -> str:
    return (f"{PREFIX}step {step:05d}/{total:05d} loss=5.0000 lrm=1.000 dt_ms={dt_ms} tok_per_s=1000 mfu=1.0 "
            f"compute_ms=100 optim_ms=10 comm_wait_ms=5\n")


def outer_line(k: int, step: int, h: int, sync_s: float = 2.5) -> str:
    return (f"{PREFIX}outer step {k} at step {step:05d}: sync_s={sync_s:.2f} wait_s=0.10 pseudo_grad_norm=0.1000 "
            f"sent_mb=20.0 H={h}\n")


def fixed_h_output(h: int, steps: int) -> str:
    """As the trainer logs it: a boundary's outer line before its step line, the last step a boundary."""
    out, k = "", 0
    for s in range(1, steps + 1):
        if s % h == 0 or s == steps:
            k += 1
            out += outer_line(k, s, h)
        out += step_line(s, steps, 3000 if s % h == 0 or s == steps else 1000)
    return out


def args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"steps": 4, "auto_steps": 100, "warmup_steps": 2, **kw})


def test_a_node_batch_grows_the_clusters_step_and_keeps_the_solos():
    per_depth = {8: 12_288}
    assert [step_tokens(args(tokens_per_step=per_depth, batch_per="cluster"), 8, w) for w in (1, 3)] == [12_288] * 2
    assert [step_tokens(args(tokens_per_step=per_depth, batch_per="node"), 8, w) for w in (1, 3)] == [12_288, 36_864]


def test_sync_every_values():
    assert [sync_every_value(v) for v in ("1", "08", "auto")] == ["1", "8", "auto"]
    for bad in ("0", "-2", "x", "1.5", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            sync_every_value(bad)


def test_steps_cover_the_first_sync_and_two_whole_periods():
    assert steps_for("1", args()) == 4  # --steps, as before
    assert steps_for("8", args()) == 24  # warm-up inside the first period: 8 + 2 x 8
    assert steps_for("2", args(warmup_steps=5)) == 10  # first sync at or after step 5 is step 6
    assert steps_for("auto", args()) == 100


def test_h1_window_is_the_steps_after_warmup():
    assert measured_window("".join(step_line(s, 4, 1000) for s in range(1, 5)), "1", 2, 4) == (2, 4, 1)
    assert measured_window("", "1", 5, 4) == (3, 4, 1)  # too few steps: at least the last one


def test_fixed_h_window_runs_from_a_sync_to_a_sync():
    out = fixed_h_output(8, steps_for("8", args()))
    first, last, h = measured_window(out, "8", 2, 24)
    assert (first, last, h) == (8, 24, 8)  # steps 9..24: the syncs of steps 16 and 24, not 8's


def test_a_final_partial_period_stays_out():
    out = fixed_h_output(8, 30)  # the last sync comes after 6 steps
    assert measured_window(out, "8", 2, 30)[:2] == (8, 24)


def auto_output(h: int, steps: int, first: int = 2) -> str:
    """The trainer's auto: a timed outer sync after `first` steps picks H, then every H and the last step."""
    out, k = "", 0
    for s in range(1, steps + 1):
        if s == first:
            out += f"{PREFIX}sync-every auto: H={h} (outer sync 0.40 s, slowest node's inner step 0.70 s: ...)\n"
        if s == first or s == steps or (s > first and (s - first) % h == 0):
            k += 1
            out += outer_line(k, s, h)
        out += step_line(s, steps, 1000)
    return out


def test_auto_window_starts_after_the_pick():
    assert measured_window(auto_output(10, 60), "auto", 2, 60) == (2, 52, 10)  # not step 60's short period
    assert measured_window(auto_output(10, 60, first=4), "auto", 0, 60) == (4, 54, 10)


def overlapped_auto_output(h: int, steps: int) -> str:
    """auto overlapped, as the trainer logs it: the timed first sync (step 2) and the run's last block,
    the ones between cross in the background."""
    out = auto_output(h, steps)
    lines = out.splitlines(keepends=True)
    outer = [i for i, line in enumerate(lines) if " outer step " in line]
    for i in outer[1:-1]:
        lines[i] = lines[i].replace(f"H={h}\n", f"H={h} overlapped: it crosses in the background\n")
    return "".join(lines)


def test_an_overlapped_run_is_measured_from_a_sync_in_the_background_to_one_before_its_last():
    """With --outer-overlap the run's last sync blocks, once a run: a window that ended there would
    charge it to a period (auto's H = 32 of 130 steps ended one there and measured 0.68). The period
    after auto's timed first sync, which blocks, has no sync behind its steps: a window starting
    there read 0.96 at depth 12 over 10 Mbit/s."""
    out = overlapped_auto_output(10, 52)
    assert measured_window(out, "auto", 2, 52) == (12, 42, 10)
    assert whole_periods_logged(out, 2) == 3  # steps 13-42
    assert whole_periods_logged(out[: out.index(step_line(23, 52, 1000))], 2) == 1  # steps 13-22
    assert measured_window(auto_output(10, 52), "auto", 2, 52) == (2, 52, 10)  # blocking: a period like any


def test_auto_periods_are_counted_once_their_last_step_is_logged():
    """--auto-periods cuts a run on this count: a period ends with its boundary's step line, which
    the trainer logs after the outer line."""
    out = auto_output(10, 60)
    assert whole_periods_logged(out[: out.index("H=10 (")], 2) == 0  # not picked yet
    assert whole_periods_logged(out[: out.index(step_line(12, 60, 1000))], 2) == 0  # 12's outer line, not its step
    assert whole_periods_logged(out[: out.index(step_line(13, 60, 1000))], 2) == 1  # steps 3-12
    assert whole_periods_logged(out, 2) == 5  # steps 3-52; step 60 ends a short one


def test_auto_without_a_whole_period_names_the_steps_to_run():
    with pytest.raises(SystemExit, match="run at least 62 steps"):
        measured_window(auto_output(30, 20), "auto", 2, 20)


def test_a_trainer_without_outer_lines_is_refused():
    with pytest.raises(SystemExit, match="no outer sync"):
        measured_window("".join(step_line(s, 24, 1000) for s in range(1, 25)), "8", 2, 24)
    with pytest.raises(SystemExit, match="auto: H="):
        measured_window(fixed_h_output(8, 24), "auto", 2, 24)


def test_results_written_before_the_axis_still_load():
    old = {"depth": 4, "nodes": 1, "link": "-", "cpu": "0.6", "split": "off", "comm": "fp32", "tokens_per_step": 3072,
           "tok_per_s": 1967.0, "step_ms": 1562, "compute_ms": 1500, "optim_ms": 60, "comm_wait_ms": 0, "rows": ""}
    r = Result(**old)
    assert (r.sync_every, r.h, r.outer_sync_ms) == ("1", 1, None)


def test_window_mean_counts_each_boundary_step_once():
    mean = window_means(fixed_h_output(8, 24), "8", 2, 24)
    assert mean["dt"] == (14 * 1000 + 2 * 3000) / 16  # steps 9..24, the boundaries 16 and 24 at 3 s
    assert (mean["h"], mean["outer_sync_ms"], mean["periods"]) == (8, 2500, 2)


def printing(*lines: str, then_sleep: float, after: Path | None = None, mark: Path | None = None) -> subprocess.Popen:
    """A process that prints `lines` (once file `after` exists, if given; then it creates `mark`)
    and then sleeps, as a trainer writing its final checkpoint."""
    code = ["import os, time"]
    if after is not None:
        code.append(f"while not os.path.exists({str(after)!r}): time.sleep(0.05)")
    code.append(f"print({chr(10).join(lines)!r}, flush=True)")
    if mark is not None:
        code.append(f"open({str(mark)!r}, 'w').close()")
    code.append(f"time.sleep({then_sleep})")
    return subprocess.Popen([sys.executable, "-c", "\n".join(code)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def test_a_run_is_cut_once_it_is_measured_and_keeps_its_output(tmp_path: Path):
    # rank 0's verdict comes after rank 1 has printed: a slow interpreter start must not cut rank 1 off first
    printed = tmp_path / "rank1-printed"
    procs = [printing(step_line(4, 4, 1000).strip(), "at the end: FASTER THAN ONE NODE", then_sleep=120,
                      after=printed),
             printing("rank 1", then_sleep=120, mark=printed)]
    t0 = time.time()
    outs, cut, timed_out = collect(procs, 100, lambda outs: "at the end:" in outs[0],
                                   lambda: [p.kill() for p in procs])
    assert (cut, timed_out) == (True, False)
    assert time.time() - t0 < 30  # not the 120-s "checkpoint"
    assert "at the end: FASTER" in outs[0] and last_step_logged(outs[0], 4) and outs[1] == "rank 1\n"


def test_a_run_past_its_timeout_is_killed_and_said_so():
    procs = [printing("step 1", then_sleep=120)]
    outs, cut, timed_out = collect(procs, 2, lambda outs: False, lambda: [p.kill() for p in procs])
    assert (cut, timed_out, outs) == (False, True, ["step 1\n"])


def test_a_run_that_ends_by_itself_is_neither_cut_nor_timed_out():
    procs = [printing(step_line(3, 4, 1000).strip(), then_sleep=0)]
    outs, cut, timed_out = collect(procs, 100, lambda outs: False, lambda: pytest.fail("killed a finished run"))
    assert (cut, timed_out) == (False, False) and not last_step_logged(outs[0], 4) and last_step_logged(outs[0], 3)
