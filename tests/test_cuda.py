"""The CUDA path on a real GPU: skipped where torch sees none (the development machine has none,
so these run only on a CUDA node: `pytest tests/test_cuda.py` there).

What they catch is what a CPU run cannot: a tensor left on the CPU next to CUDA parameters (the
fused AdamW's step counts, optimizer state loaded from a checkpoint) or handed to an NCCL
collective (the timing and calibration exchanges), which crash a CUDA run at its first step, its
tenth, or its resume.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from tests.trainer_runs import REPO, losses, node_env, run_torchrun, tiny_flags, train_target

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")


def train_and_resume(nproc: int, flags: list[str], out) -> str:
    """Run 12 steps, drop the last checkpoint, resume from step 8: the resumed losses must follow
    the uninterrupted run's (GPU reductions are not bit-reproducible: a loose tolerance)."""
    first = run_torchrun(nproc, train_target(*flags), timeout=600)
    assert first.returncode == 0, first.stdout + first.stderr
    full = losses(first.stdout)
    assert sorted(full) == list(range(1, 13)) and full[12] < full[1]
    shutil.rmtree(out / "checkpoints" / "step_000012")
    second = run_torchrun(nproc, train_target(*flags), timeout=600)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "resumed from checkpoint step 8" in second.stdout
    for step, loss in losses(second.stdout).items():
        assert loss == pytest.approx(full[step], abs=0.02), f"step {step}: {loss} vs {full[step]}"
    return first.stdout


def test_one_gpu_trains_and_resumes(tiny_data_dir, tiny_tokenizer_dir, tmp_path):
    """As a CUDA node runs by default: bf16 autocast and a compiled model (compiled twice here)."""
    out = tmp_path / "run"
    stdout = train_and_resume(1, tiny_flags(tiny_data_dir, tiny_tokenizer_dir, out, device="cuda",
                                            eval_every=6, compile="auto"), out)
    assert "device=cuda:0" in stdout and "dtype=torch.bfloat16 (auto: --device cuda" in stdout
    assert "compile=on (auto: compile pays off on CUDA)" in stdout and "val_bpb=" in stdout


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="two ranks need two GPUs")
def test_two_gpus_train_with_measured_split_and_resume(tiny_data_dir, tiny_tokenizer_dir, tmp_path):
    out = tmp_path / "run"
    stdout = train_and_resume(2, tiny_flags(tiny_data_dir, tiny_tokenizer_dir, out, device="cuda",
                                            compile="off", rank_batch_sizes="auto"), out)
    assert "backend=nccl" in stdout and "calibrated work split" in stdout
    assert "timing step 00010" in stdout  # the timing exchange went through NCCL


def test_bench_measures_a_gpu():
    proc = subprocess.run([sys.executable, "-m", "nanochat_cpu.bench", "--device", "cuda", "--dtype", "bfloat16",
                           "--depth", "2", "--vocab-size", "4096", "--steps", "3", "--warmup", "1"],
                          env=node_env(), capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout)
    assert result["device"] == "cuda" and result["tok_per_s"] > 0 and result["peak_gpu_mib_rank0"] > 0
