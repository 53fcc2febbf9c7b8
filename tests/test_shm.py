"""When ranks share their optimizer buffers in /dev/shm, and what they say when they cannot.

The sharing itself is tested on real processes in test_dist_optim (2 and 3 ranks equal 1 rank)
and test_train_runs (a 2-rank run that resumes through it)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from nanochat_cpu.shm import make_arena, plan

CPU = torch.device("cpu")


def test_one_launcher_on_one_host_shares() -> None:
    ok, why = plan("auto", 2, 2, CPU, 1 << 20)
    assert ok and "all 2 ranks on this host share parameters, gradients and optimizer state in /dev/shm (1 MiB)" in why


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        (("auto", 1, 1, CPU, 1), "one rank"),
        (("gloo", 2, 2, CPU, 1), "asked for"),
        (("auto", 3, 1, CPU, 1), "the ranks span hosts (1 of 3 on this one)"),
        (("auto", 2, 2, torch.device("cuda"), 1), "NCCL already uses shared memory"),
    ],
)
def test_reasons_not_to_share(args: tuple, reason: str) -> None:
    ok, why = plan(*args)
    assert not ok and reason in why


def test_a_small_shm_is_named_with_the_sizes_and_the_fix(tmp_path: Path) -> None:
    free = shutil.disk_usage(tmp_path).free
    ok, why = plan("auto", 2, 2, CPU, free, shm_dir=tmp_path)
    assert not ok
    assert f"{tmp_path} has" in why and f"the buffers need {free / 2**20:.0f} MiB" in why and "--shm-size" in why
    ok, why = plan("auto", 2, 2, CPU, 1, shm_dir=tmp_path / "missing")
    assert not ok and "does not exist" in why


def test_shm_where_impossible_is_an_error_not_a_fallback() -> None:
    with pytest.raises(ValueError, match=r"--local-comm shm is not possible: device cuda.*Fix: --local-comm auto"):
        make_arena("shm", 0, 2, torch.device("cuda"), torch.nn.Linear(4, 4))
    arena, why = make_arena("auto", 0, 1, CPU, torch.nn.Linear(4, 4))
    assert arena is None and why == "auto: through the process group (one rank)"
