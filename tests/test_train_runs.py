"""The trainer end to end on real torchrun + Gloo processes on loopback."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import socket
import sqlite3
import subprocess
import time

import pytest
import torch

from nanochat_cpu.dist import EXIT_MISMATCH
from nanochat_cpu.run_state import RunState
from tests.trainer_runs import (
    ENTRY_POINTS,
    REPO,
    SLOW_CHECKPOINT_TRAIN,
    SMALL_ROUNDS,
    busy_loops,
    finish,
    free_port,
    kill_tree,
    losses,
    node_env,
    read_until,
    run_torchrun,
    spawn_node,
    tiny_flags,
    torchrun_cmd,
    train_target,
)


def test_bad_batch_arithmetic_fails_every_rank_before_rendezvous(tiny_data_dir, tiny_tokenizer_dir, tmp_path):
    proc = run_torchrun(2, train_target(*tiny_flags(tiny_data_dir, tiny_tokenizer_dir, tmp_path,
                                                     total_batch_size=300)), timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "--total-batch-size=300 is not divisible by" in out
    assert "2 x 64 x 2 = 256" in out and "Nearest valid --total-batch-size: 256 or 512" in out
    assert "fingerprint" not in out  # nobody got as far as the process group


def test_two_ranks_train_resume_reproduces_losses(tiny_data_dir, tiny_tokenizer_dir, tmp_path):
    # rank 0 opens the MLflow store before step 0's checksum: on a loaded machine that is slower
    # than the tests' usual 20-s collective timeout allows
    # (the checkpoints cross in rounds of 8 KiB: the two ranks share a disk, so rank 1's state goes
    # to the disk's writer alone, in many rounds, and the resume below reads it back)
    flags = tiny_flags(tiny_data_dir, tiny_tokenizer_dir, tmp_path / "run", tracking_uri="", collective_timeout=120,
                       compile="auto")
    first = run_torchrun(2, [SLOW_CHECKPOINT_TRAIN, *flags], env_extra=SMALL_ROUNDS)
    assert first.returncode == 0, first.stdout + first.stderr
    assert re.search(r"checkpoint step 8 saved to \S+ in [0-9.]+s; [0-9.]+ MiB of 2 ranks' states in \d\d+ round",
                     first.stdout), first.stdout
    full = losses(first.stdout)
    # --compile auto: the ranks time steps 2-4 together and find 8 steps too few to pay for a compile
    assert re.search(r"rank 0/2\] compile off \(auto: eager [\d.]+ s/step; the 8 steps left take [\d.]+ min, "
                     r"under 10x a compile \(~90 s\): not tried\)", first.stdout), first.stdout
    assert sorted(full) == list(range(1, 13))
    assert "fingerprint agreed across 2 rank(s)" in first.stdout
    # every rank shows its own progress, one line a step (docs/FAILURES.md row 14), apart from rank 0's
    rank1 = re.findall(r"rank 1/2\] step (\d+)/00012 \([0-9.]+%\) rank_loss=[0-9.]+ dt_ms=\d+ tok_per_s=\d+",
                       first.stdout)
    assert [int(s) for s in rank1] == list(range(1, 13))
    # the parameter breakdown and the FLOPs behind MFU, once, from rank 0 (docs/FAILURES.md row 18)
    assert len(re.findall(r"rank 0/2\] parameters: matrix=[\d,]+, embedding=[\d,]+, value_embedding=[\d,]+, "
                          r"lm_head=[\d,]+, scalar=[\d,]+, total=[\d,]+ \| FLOPs/token \(for MFU\) = [\d,]+",
                          first.stdout)) == 1
    # one launcher, one host: the optimizer shares its buffers instead of sending them (and resumes so)
    assert "local comm: auto: all 2 ranks on this host share parameters, gradients and optimizer state" in first.stdout
    # flags went through torchrun unharmed (docs/FAILURES.md row 10): the run name reached MLflow
    db = tmp_path / "run" / "mlflow.db"
    with sqlite3.connect(db) as con:
        names = {r[0] for r in con.execute("select name from runs")}
        metrics = {r[0] for r in con.execute("select distinct key from metrics")}
    assert names == {"test"} and {"loss/train_loss", "speed/tok_per_s", "speed/mfu", "loss/val_bpb",
                                  "speed/vs_fastest_node_est", "ranks/comm_wait_ms_rank1"} <= metrics
    # whether two ranks beat one alone is said once at the first timing step (docs/FAILURES.md row 16),
    # and again at the end for the run's summary
    # (both ranks on this host: the comparison is with this host as one process, not with one rank)
    said = re.findall(r"\] (at the end: )?(?:SLOW|FAST)ER THAN ONE NODE: cluster [\d,]+ tok/s with 2 ranks = [\d.]+x "
                      r"what ranks 0\+1@\S+ would do alone as one", first.stdout)
    assert said == ["", "at the end: "]
    # where the run stands, for status.yml: the master's status file, replaced every step (run_status.py)
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    last_bpb = float(re.findall(r"eval step \d+ val_bpb=([0-9.]+)", first.stdout)[-1])
    assert (status["state"], status["step"], status["total"], status["loss_of"]) == ("done", 12, 12, "run")
    assert status["loss"] == pytest.approx(full[12], abs=1e-4)
    assert status["val_bpb"] == pytest.approx(last_bpb, abs=1e-4)
    assert status["verdict"].startswith("at the end: ") and status["sample"].startswith("'The")
    assert status["gpu_note"] is None and "NOTE: this host" not in first.stdout  # no GPU here: nothing to say
    assert status["eta"] == "0s" and status["tok_per_s"] > 0 and status["world_size"] == 2

    # crash after step 8's checkpoint: drop the newer one, as if the run died before it
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "step_000012")
    second = run_torchrun(2, [SLOW_CHECKPOINT_TRAIN, *flags], env_extra=SMALL_ROUNDS)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "resumed from checkpoint step 8" in second.stdout
    assert "compile off (auto: eager" in second.stdout and "chosen earlier in this run, kept on resume" in second.stdout
    resumed = losses(second.stdout)
    assert sorted(resumed) == [9, 10, 11, 12]
    for step, loss in resumed.items():
        assert loss == pytest.approx(full[step], abs=1e-4), f"step {step}: {loss} vs uninterrupted {full[step]}"


def test_every_trainer_flag_passes_through_torchrun_unharmed():
    """torchrun's own parser (torch.distributed.run, what the units run) must hand every trainer
    flag, in both spellings, to the trainer: a flag torchrun took for an abbreviation of one of its
    own options (`--run` for `--run-path`, docs/FAILURES.md row 10) would be swallowed or refused."""
    from torch.distributed.run import parse_args

    from nanochat_cpu.config import build_parser

    options = [a.option_strings[0] for a in build_parser()._actions if a.option_strings and a.dest != "help"]
    assert len(options) > 30
    for argv in ([x for o in options for x in (o, "1")], [f"{o}=1" for o in options]):
        args = parse_args(["--nproc-per-node=2", "-m", "nanochat_cpu.train", *argv])
        assert args.module and args.training_script == "nanochat_cpu.train"
        assert args.training_script_args == argv


def test_fingerprint_mismatch_stops_every_rank(tiny_data_dir, tiny_tokenizer_dir, tmp_path):
    """Node 1 has a drifted shard and another --matrix-lr in its env file: both are named, with
    the hashes on each side, on every rank, before step 1."""
    drifted = tmp_path / "drifted"
    shutil.copytree(tiny_data_dir, drifted)
    with open(drifted / "shard_00001.parquet", "ab") as f:
        f.write(b"drift")
    port = free_port()
    t0 = time.monotonic()
    nodes = [spawn_node(2, rank, port, train_target(*tiny_flags(data, tiny_tokenizer_dir, tmp_path / f"n{rank}",
                                                                **over)))
             for rank, (data, over) in enumerate([(tiny_data_dir, {}), (drifted, {"matrix_lr": 0.05})])]
    results = [finish(p, timeout=60) for p in nodes]
    assert time.monotonic() - t0 < 30 + 15  # 30 s budget plus two cold torch imports on 2 cores
    host = re.escape(socket.gethostname())
    for code, out, _ in results:
        assert code == EXIT_MISMATCH, out
        assert "run fingerprint mismatch" in out
        assert re.search(rf"file data/shard_00001.parquet: {host} has [0-9a-f]{{16}}, {host} has [0-9a-f]{{16}}", out)
        assert re.search(rf"run config hash: {host} [0-9a-f]{{16}} vs {host} [0-9a-f]{{16}}", out), out
        assert "step 00001" not in out


def test_killing_one_rank_makes_the_other_exit(tiny_data_dir, tiny_tokenizer_dir, tmp_path):
    port = free_port()
    flags = tiny_flags(tiny_data_dir, tiny_tokenizer_dir, tmp_path, num_iterations=100000, checkpoint_every=0,
                       collective_timeout=15)
    nodes = [spawn_node(2, rank, port, train_target(*flags)) for rank in range(2)]
    try:
        read_until(nodes[0], "step 00003", timeout=90)
        kill_tree(nodes[1].pid, signal.SIGKILL)  # the trainer and its torchrun, like a node dying
        code, out, waited = finish(nodes[0], timeout=15 + 60)
    finally:
        for p in nodes:
            kill_tree(p.pid, signal.SIGKILL)
    assert code != 0
    assert waited < 15 + 30 + 10, f"survivor took {waited:.0f}s to give up"
    assert "FATAL" in out and "collective" in out and "rank 1@" in out


@pytest.mark.skipif((os.cpu_count() or 1) < 2 or not shutil.which("taskset"), reason="needs 2 CPUs and taskset")
def test_measured_split_gives_the_faster_node_more_rows_and_resume_keeps_it(tiny_data_dir, tiny_tokenizer_dir,
                                                                            tmp_path):
    """Node 1 shares its core with two busy loops (a third of a core): the start-up calibration must
    see it and give node 0 more rows; the step's tokens stay the same, and a resumed run reuses the
    split from the checkpoint instead of measuring again (docs/FAILURES.md row 16)."""
    def flags(rank: int) -> list[str]:  # each node its own run directory, as on real machines
        return tiny_flags(tiny_data_dir, tiny_tokenizer_dir, tmp_path / f"node{rank}", rank_batch_sizes="auto")

    def two_nodes() -> list[tuple[int, str, float]]:
        port = free_port()
        nodes = [subprocess.Popen(["taskset", "-c", str(rank), *torchrun_cmd(1, port, train_target(*flags(rank)), 2,
                                                                            rank)],
                                  env=node_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  cwd=REPO, start_new_session=True) for rank in range(2)]
        try:
            return [finish(p, timeout=180) for p in nodes]
        finally:
            for p in nodes:
                kill_tree(p.pid, signal.SIGKILL)

    hogs = busy_loops(core=1)
    try:
        first = two_nodes()
        for rank in range(2):
            shutil.rmtree(tmp_path / f"node{rank}" / "checkpoints" / "step_000012")
        second = two_nodes()
    finally:
        for h in hogs:
            h.kill()
    (code0, out0, _), (code1, out1, _) = first
    assert code0 == 0 and code1 == 0, out0 + out1
    split = re.search(r"calibrated work split: rank 0@\S+ (\d+) ms/micro-batch -> (\d+) rows, "
                      r"rank 1@\S+ (\d+) ms/micro-batch -> (\d+) rows", out0)
    assert split, out0
    fast_ms, fast_rows, slow_ms, slow_rows = map(int, split.groups())
    assert slow_ms > 1.5 * fast_ms and (fast_rows, slow_rows) == (3, 1), split.group(0)
    assert "batch: 256 tokens/step = 1 micro-steps x rows [3, 1] x 64 tokens" in out0
    (code0, again, _), (code1, out1, _) = second
    assert code0 == 0 and code1 == 0, again + out1
    assert "work split from the checkpoint: [3, 1]" in again and "calibrated" not in again
    full, resumed = losses(out0), losses(again)
    assert sorted(resumed) == [9, 10, 11, 12]
    for step, loss in resumed.items():
        assert loss == pytest.approx(full[step], abs=1e-4), f"step {step}: {loss} vs uninterrupted {full[step]}"


@pytest.mark.skipif((os.cpu_count() or 1) < 2 or not shutil.which("taskset"), reason="needs 2 CPUs and taskset")
def test_a_split_measured_while_a_host_was_busy_is_corrected_by_the_first_steps(tiny_data_dir, tiny_tokenizer_dir,
                                                                                tmp_path):
    """Two busy loops share node 1's core while the ranks calibrate, then stop, as a controller's
    ansible does on a host that is also a node: the calibration gives node 0 most of the eight rows,
    the first timed steps show the nodes equally fast, and the split goes back to four rows each
    (or within a row of it);
    the next checkpoints hold the new split. The rows are long enough (4 layers of width 256, 256
    tokens) that a row's compute, not a step's fixed costs, is what the ranks time, and many enough
    that no rank is left with one row: a 1-row pass costs 10-40% more per row on these CPUs, which
    the check's rows x seconds-per-row model does not know, so a [3, 1] split could look settled."""
    rows_that_cost = {"depth": 4, "aspect_ratio": 64, "max_seq_len": 256, "device_batch_size": 4,
                      "total_batch_size": 2048}
    port = free_port()
    hogs = busy_loops(core=1)
    try:
        nodes = [subprocess.Popen(["taskset", "-c", str(rank), *torchrun_cmd(
                     1, port, train_target(*tiny_flags(tiny_data_dir, tiny_tokenizer_dir, tmp_path / f"node{rank}",
                                                       rank_batch_sizes="auto", **rows_that_cost)), 2, rank)],
                                  env=node_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  cwd=REPO, start_new_session=True) for rank in range(2)]
        try:
            seen = read_until(nodes[0], "calibrated work split", 120)
        finally:
            for h in hogs:
                h.kill()
        (code0, rest, _), (code1, out1, _) = [finish(p, timeout=180) for p in nodes]
    finally:
        for p in [*hogs, *nodes]:
            kill_tree(p.pid, signal.SIGKILL)
    out0 = seen + rest
    assert code0 == 0 and code1 == 0, out0 + out1
    calibrated = re.search(r"batch: 2,048 tokens/step = 1 micro-steps x rows \[(\d+), (\d+)\] x 256 tokens", out0)
    assert calibrated and int(calibrated.group(1)) >= 5, out0  # node 1 looked at least 1.6x slower
    checked = re.search(r"work split checked against steps to (\d+): rank 0@\S+ \d+ ms/row, rank 1@\S+ \d+ ms/row -> "
                        rf"rows \[(\d+), (\d+)\] instead of \[{calibrated.group(1)}, {calibrated.group(2)}\]", out0)
    assert checked, out0
    assert int(checked.group(1)) == 3  # steps 2 and 3: a process's first step is not timed
    # back to even, or within a row of it: the check has two ~1-s steps on a shared 2-vCPU host (in
    # one CI run rank 1 measured 183 ms/row on 2 rows there, then 134 on 3, as fast as rank 0)
    split = [int(checked.group(2)), int(checked.group(3))]
    assert split in ([4, 4], [5, 3]) and split[0] < int(calibrated.group(1)), out0
    assert f"batch: 2,048 tokens/step = 1 micro-steps x rows {split} x 256 tokens" in out0
    full = losses(out0)
    assert sorted(full) == list(range(1, 13))
    saved = torch.load(tmp_path / "node0" / "checkpoints" / "step_000004" / "rank0.pt", weights_only=False)
    assert RunState.of_rank_file(saved).rank_batch_sizes == split
    # resumed from step 8, with node 1's core busy again throughout: the checkpoint's split was
    # checked, so it stays (a new one would change the redone steps' losses), and the losses equal
    # the uninterrupted run's, which also shows the re-split run's loader and loss weights were right
    # (four steps, not eight from step 4: a step with node 1's core shared three ways is slow)
    for rank in range(2):
        shutil.rmtree(tmp_path / f"node{rank}" / "checkpoints" / "step_000012")
    port = free_port()
    hogs = busy_loops(core=1)
    try:
        again = [subprocess.Popen(["taskset", "-c", str(rank), *torchrun_cmd(1, port, train_target(*tiny_flags(
                     tiny_data_dir, tiny_tokenizer_dir, tmp_path / f"node{rank}", rank_batch_sizes="auto",
                     **rows_that_cost)), 2, rank)], env=node_env(), stdout=subprocess.PIPE,
                     stderr=subprocess.STDOUT, text=True, cwd=REPO, start_new_session=True) for rank in range(2)]
        try:
            (code0, resumed_out, _), (code1, out1, _) = [finish(p, timeout=240) for p in again]
        finally:
            for p in again:
                kill_tree(p.pid, signal.SIGKILL)
    finally:
        for h in hogs:
            h.kill()
    assert code0 == 0 and code1 == 0, resumed_out + out1
    assert f"work split from the checkpoint: {split}" in resumed_out
    assert "work split checked" not in resumed_out, resumed_out
    resumed = losses(resumed_out)
    assert sorted(resumed) == list(range(9, 13)), resumed_out
    for step, loss in resumed.items():
        assert loss == pytest.approx(full[step], abs=1e-4), f"step {step}: {loss} vs uninterrupted {full[step]}"


@pytest.mark.parametrize(("native_ranks", "dtype", "why"), [
    ("", "float32", "auto: fp32 because rank 0@{host}, rank 1@{host} lack native bf16"),
    ("0", "float32", "auto: fp32 because rank 1@{host} lacks native bf16"),
    ("0,1", "bfloat16", "auto: every rank's CPU has native bf16"),
])
def test_cuda_present_but_cpu_requested_uses_cpu_dtype_sdpa_gloo(native_ranks, dtype, why, tiny_data_dir,
                                                                 tiny_tokenizer_dir, tmp_path):
    """A GPU in the box changes nothing: gloo, SDPA, and bf16 only where every rank's CPU has it."""
    flags = tiny_flags(tiny_data_dir, tiny_tokenizer_dir, tmp_path, num_iterations=2, checkpoint_every=0,
                       compile="auto")
    proc = run_torchrun(2, [str(ENTRY_POINTS / "fake_cuda_train.py"), *flags],
                        env_extra={"FAKE_NATIVE_BF16_RANKS": native_ranks})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    banners = [line for line in out.splitlines() if "backend=" in line]
    assert len(banners) == 2
    for line in banners:
        assert "cuda_available=True" in line
        assert f"device=cpu backend=gloo dtype=torch.{dtype} ({why.format(host=socket.gethostname())}" in line
        assert "attention=SDPA" in line
        # auto measures the CPU (or stays eager without a C++ compiler), never compiles for an unused GPU
        assert "compile=auto (auto: eager steps 2-4 are timed" in line or "compile=off (auto: no C++" in line
    # the idle GPU is said once (one node: its status file's writer), with both measured peaks,
    # and kept for status.yml; the run stays on the CPU
    notes = re.findall(r"rank (\d)/2\] NOTE: (this host .*)", out)
    assert len(notes) == 1, out
    assert re.fullmatch(rf"this host \({re.escape(socket.gethostname())}\) has a CUDA GPU, Fake GeForce RTX 4070, "
                        r"that this run leaves idle: it trains on CPU \(--device cpu\)\. Measured matmul peaks: "
                        rf"GPU 29,500 GFLOP/s \(bfloat16\), CPU [\d,]+ GFLOP/s per rank \({dtype}\)\. To train on it: "
                        r"train_device: cuda .*", notes[0][1]), notes[0][1]
    assert json.loads((tmp_path / "status.json").read_text())["gpu_note"] == notes[0][1]


# The tolerance docs/TRAINER.md states for `--dtype auto` choosing bf16 on CPU: at every step the
# loss is within 0.05 nats of the fp32 run's, and val bpb within 1%. Measured on the depth-4
# acceptance run (200 steps): 0.029 at most, 0.005 on average, val bpb 2.4612 against 2.4639.
BF16_LOSS_TOLERANCE, BF16_BPB_TOLERANCE = 0.05, 0.01


def test_bf16_autocast_trains_like_fp32(tiny_data_dir, tiny_tokenizer_dir, tmp_path):
    runs = {}
    for dtype in ("float32", "bfloat16"):
        flags = tiny_flags(tiny_data_dir, tiny_tokenizer_dir, tmp_path / dtype, num_iterations=40,
                           checkpoint_every=0, eval_every=40, dtype=dtype)
        proc = run_torchrun(1, train_target(*flags))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert f"dtype=torch.{dtype} (requested" in proc.stdout + proc.stderr
        bpb = re.search(r"eval step 00040 val_bpb=([0-9.]+)", proc.stdout)
        assert bpb, proc.stdout
        runs[dtype] = losses(proc.stdout), float(bpb.group(1))
    (fp32, fp32_bpb), (bf16, bf16_bpb) = runs["float32"], runs["bfloat16"]
    assert sorted(fp32) == sorted(bf16) == list(range(1, 41))
    assert fp32[40] < fp32[1] - 1.0  # it learned something, so the comparison means something
    worst = max(abs(fp32[s] - bf16[s]) for s in fp32)
    assert 0 < worst <= BF16_LOSS_TOLERANCE  # 0: bf16 was not actually used
    assert bf16_bpb == pytest.approx(fp32_bpb, rel=BF16_BPB_TOLERANCE)


def test_loss_falls_well_below_uniform(tiny_data_dir, tiny_tokenizer_dir, tmp_path):
    flags = tiny_flags(tiny_data_dir, tiny_tokenizer_dir, tmp_path, num_iterations=60, checkpoint_every=0,
                       eval_every=30, sample_every=30)
    proc = run_torchrun(2, train_target(*flags))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = losses(proc.stdout)
    assert got[1] > math.log(512) - 0.5
    assert sum(got[s] for s in range(51, 61)) / 10 < math.log(512) - 1.5
    assert re.search(r"val_bpb=\d", proc.stdout) and "sample step 00060" in proc.stdout
