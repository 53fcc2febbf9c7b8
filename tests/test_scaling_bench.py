"""cluster/scaling_bench.py's --sync-every axis: the steps each H runs and the window it measures,
on made-up rank 0 output (the bench itself needs the container cluster)."""

from __future__ import annotations

import argparse

import pytest

from cluster.scaling_bench import Result, measured_window, steps_for, sync_every_value, window_means

PREFIX = "[node0 rank 0/3] "


def step_line(step: int, total: int, dt_ms: int) -> str:
    return (f"{PREFIX}step {step:05d}/{total:05d} loss=5.0000 lrm=1.000 dt_ms={dt_ms} tok_per_s=1000 mfu=1.0 "
            f"compute_ms=100 optim_ms=10 comm_wait_ms=5\n")


def outer_line(k: int, step: int, h: int, sync_s: float = 2.5) -> str:
    return f"{PREFIX}outer step {k} at step {step}: sync_s={sync_s} pseudo_grad_norm=0.1 sent_mb=20.0 H={h}\n"


def fixed_h_output(h: int, steps: int) -> str:
    out = ""
    for s in range(1, steps + 1):
        out += step_line(s, steps, 3000 if s % h == 0 else 1000)
        if s % h == 0:
            out += outer_line(s // h, s, h)
    return out


def args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"steps": 4, "auto_steps": 100, "warmup_steps": 2, **kw})


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
    out = fixed_h_output(8, 30) + outer_line(4, 30, 8)  # the trainer's last sync after 6 steps
    assert measured_window(out, "8", 2, 30)[:2] == (8, 24)


def test_auto_window_starts_after_the_pick():
    out = step_line(1, 60, 1000) + outer_line(1, 1, 1, sync_s=0.4) + f"{PREFIX}sync-every auto: H=10 (...)\n"
    for s in range(2, 61):
        out += step_line(s, 60, 1000)
        if (s - 1) % 10 == 0:
            out += outer_line((s - 1) // 10 + 1, s, 10)
    assert measured_window(out, "auto", 2, 60) == (11, 51, 10)


def test_auto_without_a_whole_period_names_the_steps_to_run():
    out = step_line(1, 15, 1000) + outer_line(1, 1, 1) + f"{PREFIX}sync-every auto: H=10\n"
    out += "".join(step_line(s, 15, 1000) for s in range(2, 16)) + outer_line(2, 11, 10)
    with pytest.raises(SystemExit, match="run at least 31 steps"):
        measured_window(out, "auto", 2, 15)


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
    assert (mean["h"], mean["outer_sync_ms"]) == (8, 2500)
