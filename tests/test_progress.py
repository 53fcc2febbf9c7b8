"""The step line's progress and ETA, and the -1 / 0 meanings of --eval-every and --sample-every."""

from __future__ import annotations

import re
import sqlite3

import pytest

from nanochat_cpu.config import ConfigError, parse_config, validate
from nanochat_cpu.progress import MIN_WINDOW, StepClock, human_duration, window_steps
from tests.test_roles import run_validate_on_localhost
from tests.trainer_runs import run_torchrun, tiny_flags, train_target

# ---- the estimate, fed its own clock -----------------------------------------------------------


def laps(clock: StepClock, step_seconds: list[float], period: int = 1, start_step: int = 0) -> list:
    """Each step's Progress when step i takes step_seconds[i] of wall time."""
    now, out = clock.times[-1], []  # on from the last step line
    for i, seconds in enumerate(step_seconds):
        now += seconds
        out.append(clock.lap(start_step + i + 1, now, period))
    return out


def test_a_constant_step_time_gives_remaining_steps_times_it() -> None:
    clock = StepClock(total=100, started_at=1000.0)
    progress = laps(clock, [2.0] * 30)
    for p in progress:
        assert p.eta_s == pytest.approx((100 - p.step) * 2.0)
        assert p.elapsed_s == pytest.approx(p.step * 2.0)
    assert progress[11].line_head() == "step 00012/00100 (12.0%)"
    assert progress[11].line_tail() == "elapsed=24s eta=2.9m"


def test_a_slow_evaluation_in_the_window_raises_the_estimate_by_its_share() -> None:
    clock = StepClock(total=1000, started_at=0.0)
    steps = [1.0] * 30
    steps[24] += 10.0  # the step after an evaluation: its 10 s land between two step lines
    progress = laps(clock, steps)
    # 20 steps of window, one of them 10 s longer: 30 s over 20 steps, 1.5 s a step
    assert progress[29].eta_s == pytest.approx((1000 - 30) * 30 / MIN_WINDOW)
    assert progress[23].eta_s == pytest.approx(1000 - 24)  # before it: 1 s a step
    # once the slow step has left the window, the estimate is back at 1 s a step
    progress = laps(clock, [1.0] * MIN_WINDOW, start_step=30)
    assert progress[-1].eta_s == pytest.approx(1000 - 30 - MIN_WINDOW)


def test_with_local_steps_the_window_holds_whole_outer_periods() -> None:
    period = 8  # 7 inner steps of 1 s, then one of 9 s (an 8-s outer sync): 2 s a step on average
    assert window_steps(period) == 24 and window_steps(1) == MIN_WINDOW and window_steps(50) == 50
    clock = StepClock(total=400, started_at=0.0)
    steps = [1.0 if (i + 1) % period else 9.0 for i in range(80)]
    progress = laps(clock, steps, period)
    for p in progress[period - 1:]:  # from the first outer sync on: no jump at the next ones
        assert p.eta_s == pytest.approx((400 - p.step) * 2.0)
    # before a whole period has run, the estimate is what there is
    assert progress[2].eta_s == pytest.approx(400 - 3)


def test_a_resumed_run_counts_only_its_own_steps() -> None:
    clock = StepClock(total=100, started_at=50.0)  # resumed at step 60, the loop starting at t=50 s
    progress = laps(clock, [3.0] * 5, start_step=60)
    assert progress[-1].step == 65 and progress[-1].percent == 65.0
    assert progress[-1].elapsed_s == pytest.approx(15.0) and progress[-1].eta_s == pytest.approx(35 * 3.0)


@pytest.mark.parametrize(("seconds", "text"), [
    (0.4, "0s"), (45, "45s"), (59.4, "59s"), (60, "1.0m"), (738, "12.3m"), (3599, "60.0m"), (3600, "1.0h"),
    (5.2 * 3600, "5.2h"), (47.9 * 3600, "47.9h"), (48 * 3600, "2.0d"), (3.1 * 86400, "3.1d"),
])
def test_human_durations(seconds: float, text: str) -> None:
    assert human_duration(seconds) == text


# ---- -1 = never, 0 = only at the end -----------------------------------------------------------


@pytest.mark.parametrize("flag", ["eval-every", "sample-every"])
def test_minus_one_is_never_and_below_it_is_refused_naming_the_flag(flag: str) -> None:
    validate(parse_config([f"--{flag}", "-1"]), world_size=1)
    validate(parse_config([f"--{flag}", "0"]), world_size=1)
    with pytest.raises(ConfigError) as refused:
        validate(parse_config([f"--{flag}", "-2"]), world_size=1)
    assert str(refused.value) == (f"--{flag}=-2: must be -1 (never), 0 (only at the end) or a number of steps; "
                                  f"fix: --{flag} -1 to turn it off")
    assert refused.value.field == flag.replace("-", "_")
    assert refused.value.problem == "must be -1 (never), 0 (only at the end) or a number of steps"


@pytest.mark.parametrize("name", ["checkpoint_every", "checksum_every"])
def test_checkpoints_and_checksums_keep_refusing_negative_values(name: str) -> None:
    with pytest.raises(ConfigError, match=f"--{name.replace('_', '-')}=-1: must be >= 0"):
        validate(parse_config([f"--{name.replace('_', '-')}", "-1"]), world_size=1)


def test_the_run_role_passes_minus_one_through(tmp_path) -> None:
    res = run_validate_on_localhost(tmp_path, {}, "-e", "eval_every=-1", "-e", "sample_every=-1")
    assert res.returncode == 0, res.stdout + res.stderr
    args = (tmp_path / "train_args").read_text()
    assert "--eval-every -1 " in args and "--sample-every -1 " in args, args
    res = run_validate_on_localhost(tmp_path, {}, "-e", "eval_every=-2")
    assert res.returncode != 0
    said = " ".join(res.stdout.split())
    assert "eval_every=-2 must be -1 (never), 0 (only at the end) or a number of steps (" in said, said
    assert "pass e.g. -e eval_every=100" in said and "--eval-every" not in said, said


# ---- a real run --------------------------------------------------------------------------------

OLD_TOKENS = ("loss", "lrm", "dt_ms", "tok_per_s", "mfu", "compute_ms", "optim_ms", "comm_wait_ms")
STEP_LINE = re.compile(r"\] step (\d{5})/00012 \((\d+\.\d)%\) (.*) elapsed=(\S+) eta=(\S+)$", re.MULTILINE)


def test_a_run_that_never_evaluates_or_samples_still_checkpoints_and_reports_its_eta(
        tiny_data_dir, tiny_tokenizer_dir, tmp_path) -> None:
    flags = tiny_flags(tiny_data_dir, tiny_tokenizer_dir, tmp_path, eval_every=-1, sample_every=-1,
                       checkpoint_every=0, tracking_uri="")
    proc = run_torchrun(1, train_target(*flags))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "eval step" not in out and "sample step" not in out
    assert (tmp_path / "checkpoints" / "step_000012" / "COMPLETE").is_file()
    lines = STEP_LINE.findall(proc.stdout)
    assert [int(step) for step, *_ in lines] == list(range(1, 13)), proc.stdout
    for step, percent, middle, elapsed, eta in lines:
        assert float(percent) == round(100 * int(step) / 12, 1)
        assert [token.split("=")[0] for token in middle.split()] == list(OLD_TOKENS)
        assert re.fullmatch(r"\d+s|\d+\.\dm", elapsed) and re.fullmatch(r"\d+s|\d+\.\dm", eta), (elapsed, eta)
    assert lines[-1][4] == "0s"  # nothing left
    with sqlite3.connect(tmp_path / "mlflow.db") as con:
        eta = dict(con.execute("select step, value from metrics where key = 'time/eta_s'"))
        elapsed = dict(con.execute("select step, value from metrics where key = 'time/elapsed_s'"))
    assert sorted(eta) == sorted(elapsed) == list(range(1, 13))
    assert eta[12] == 0 and eta[1] > 0 and all(elapsed[s] < elapsed[s + 1] for s in range(1, 12))
