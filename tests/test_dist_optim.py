"""The distributed optimizer on real Gloo processes: N ranks must equal 1 rank."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from nanochat_cpu.optim import MuonAdamW
from nanochat_cpu.sync_strategy import Group
from tests.trainer_runs import ENTRY_POINTS, REPO, node_env, run_torchrun

WORKER = str(ENTRY_POINTS / "dist_worker.py")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, torch.Tensor]:
    out = tmp_path_factory.mktemp("ref") / "params.pt"
    proc = subprocess.run([sys.executable, WORKER, "step", str(out)], env=node_env(), capture_output=True,
                          text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return torch.load(out)


def shm_files() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("nanochat-*")}


@pytest.mark.parametrize("local_comm", ["gloo", "shm", "shm-private-grads"])
@pytest.mark.parametrize("world", [2, 3])
def test_n_rank_step_equals_one_rank_step(world, local_comm, reference, tmp_path):
    """Through Gloo, and with the ranks' buffers in shared memory (one host), the backward writing
    into them or (private-grads, as a compiled model's) its gradients copied in: the 1-rank step."""
    out = tmp_path / "params.pt"
    before = shm_files()
    env = {"LOCAL_COMM": local_comm.split("-")[0], "PRIVATE_GRADS": "1" if "private" in local_comm else ""}
    proc = run_torchrun(world, [WORKER, "step", str(out)], env_extra=env)
    assert shm_files() <= before, "the run left its shared-memory files behind"
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = torch.load(out)
    assert got.keys() == reference.keys()
    moved = 0
    for name, ref in reference.items():
        torch.testing.assert_close(got[name], ref, rtol=1e-4, atol=2e-5, msg=f"{name} differs at world={world}")
        moved += 1
    assert moved == len(reference) > 10


@pytest.mark.parametrize(("world", "grads"), [(2, "in-place"), (3, "in-place"), (2, "private")])
def test_shared_memory_step_takes_work_from_a_slow_rank(world, grads, reference, tmp_path):
    """Rank 0 is late to its step, but its gradients are complete (flagged by its backward's
    hooks; private ones, as a compiled model's, copied in by them): the other ranks do every unit
    but the tables' (whose rows rank 0 flags in its step), and the result is still the 1-rank
    step. With fixed owners rank 0 would do its share, and the others would wait for it."""
    out = tmp_path / "params.pt"
    env = {"LOCAL_COMM": "shm", "SLOW_RANK": "0", "PRIVATE_GRADS": "1" if grads == "private" else ""}
    proc = run_torchrun(world, [WORKER, "step", str(out)], env_extra=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # the ranks' lines may interleave in torchrun's output
    lines = re.findall(r"units rank=(\d+) step=(\d+) ran=(\d+) total=(\d+) tables=(\d+)", proc.stdout)
    assert len(lines) == 2 * world, proc.stdout
    total, tables = int(lines[0][3]), int(lines[0][4])
    for step in ("0", "1"):
        ran = {int(rank): int(n) for rank, s, n, _, _ in lines if s == step}
        assert sum(ran.values()) == total, f"step {step}: units done {ran}, of {total}"
        assert ran[0] <= tables < total - tables, f"step {step}: the slow rank did {ran[0]} of {total} units"
    got = torch.load(out)
    for name, ref in reference.items():
        torch.testing.assert_close(got[name], ref, rtol=1e-4, atol=2e-5, msg=f"{name} differs at world={world}")


def test_shared_memory_step_refuses_a_gradient_accumulated_twice(tmp_path):
    """Other ranks may update a weight as soon as its gradient was accumulated once in the last
    backward: a second accumulation (here a second forward and backward) is refused, not summed too late."""
    proc = run_torchrun(2, [WORKER, "step", str(tmp_path / "params.pt")],
                        env_extra={"LOCAL_COMM": "shm", "BACKWARD_TWICE": "1"}, timeout=120)
    assert proc.returncode != 0
    assert "got a second gradient in the last micro-step's backward" in proc.stdout + proc.stderr
    assert "Fix: --local-comm gloo" in proc.stdout + proc.stderr


def test_shared_memory_step_stops_when_a_rank_of_the_host_is_gone(tmp_path):
    """Rank 0 exits between its backward and its step (status 0: torchrun leaves the others
    running): rank 1, waiting for rank 0's table rows in shared memory, notices within a fraction
    of a second, names the rank and stops, instead of polling until the watchdog's bound."""
    t0 = time.monotonic()
    proc = run_torchrun(2, [WORKER, "step", str(tmp_path / "params.pt")],
                        env_extra={"LOCAL_COMM": "shm", "EXIT_RANK": "0"}, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "rank 0 (pid" in out and "exited in the middle of step 1" in out, out
    assert time.monotonic() - t0 < 60


@pytest.mark.parametrize(("world", "local_comm", "micro_rows"), [(1, "", ""), (1, "", "1"), (2, "shm", "1"),
                                                              (2, "gloo", "")])
def test_sparse_embedding_rows_equal_dense_gradients(world, local_comm, micro_rows, reference, tmp_path):
    """The tables' gradients arrive as rows and only those rows are cleared after a step: any
    row left over from the previous step or micro-step would move the result off the dense one."""
    out = tmp_path / "params.pt"
    env = {"DENSE_EMBEDDING_GRADS": "1", "LOCAL_COMM": local_comm, "MICRO_ROWS": micro_rows}
    if world == 1:
        proc = subprocess.run([sys.executable, WORKER, "step", str(out)], env={**node_env(), **env},
                              capture_output=True, text=True, timeout=120, cwd=REPO)
    else:
        proc = run_torchrun(world, [WORKER, "step", str(out)], env_extra=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = torch.load(out)
    for name, ref in reference.items():
        torch.testing.assert_close(got[name], ref, rtol=1e-4, atol=2e-5, msg=f"{name} differs from dense")


@pytest.mark.parametrize(("world", "local_comm"), [(2, "gloo"), (2, "shm"), (3, "shm")])
def test_parameters_without_gradient_count_as_zero(world, local_comm, tmp_path):
    """A parameter whose .grad is None at a step counts as a zero gradient (the reference: one
    rank given explicit zeros), not as what a buffer still holds from this step's backward or the
    last step: the LM head (its owned part and the published ones), one matrix of a Muon stack and
    the token embedding table."""
    env = {"NO_GRAD": "lm_head.weight,blocks.1.attn.c_q.weight,wte.weight", "LOCAL_COMM": local_comm}
    ref, out = tmp_path / "ref.pt", tmp_path / "params.pt"
    proc = subprocess.run([sys.executable, WORKER, "step", str(ref)],
                          env={**node_env(), **env, "NO_GRAD_AS": "zeros"},
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = run_torchrun(world, [WORKER, "step", str(out)], env_extra=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    want, got = torch.load(ref), torch.load(out)
    for name, ref_value in want.items():
        torch.testing.assert_close(got[name], ref_value, rtol=1e-4, atol=2e-5, msg=f"{name} differs")


@pytest.mark.parametrize(("split", "local_comm"), [("4,2", "gloo"), ("1,2,3", "gloo"), ("1,2,3", "shm")])
def test_uneven_token_weighted_split_equals_even_split(split, local_comm, reference, tmp_path):
    """A fast host taking more rows per step must not change what is optimised: each rank's loss is
    weighted by its share of the global batch's tokens."""
    out = tmp_path / "params.pt"
    proc = run_torchrun(len(split.split(",")), [WORKER, "step", str(out), split], env_extra={"LOCAL_COMM": local_comm})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = torch.load(out)
    for name, ref in reference.items():
        torch.testing.assert_close(got[name], ref, rtol=1e-4, atol=2e-5, msg=f"{name} differs with split {split}")


@pytest.mark.parametrize(("world", "local_comm"), [(2, "gloo"), (3, "gloo"), (2, "shm")])
def test_accumulation_with_reduce_started_in_backward_equals_one_rank(world, local_comm, reference, tmp_path):
    """One row per micro-step, the last backward starting each group's reduce-scatter from its
    gradient hooks (sync_in_backward): still the 1-rank step."""
    out = tmp_path / "params.pt"
    proc = run_torchrun(world, [WORKER, "step", str(out)], env_extra={"MICRO_ROWS": "1", "LOCAL_COMM": local_comm})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = torch.load(out)
    for name, ref in reference.items():
        torch.testing.assert_close(got[name], ref, rtol=1e-4, atol=2e-5, msg=f"{name} differs at world={world}")


def test_bf16_gradient_communication_stays_close(reference, tmp_path):
    """--grad-comm-dtype bfloat16 halves the bytes on the wire; the result moves by rounding only."""
    out = tmp_path / "params.pt"
    proc = run_torchrun(2, [WORKER, "step", str(out)], env_extra={"GRAD_COMM_DTYPE": "bfloat16"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = torch.load(out)
    for name, ref in reference.items():
        if name.startswith("blocks."):  # Muon: orthogonalisation absorbs the rounding
            torch.testing.assert_close(got[name], ref, rtol=0, atol=1e-3, msg=f"{name} moved with bf16 grads")
        else:  # AdamW turns near-cancelling sums (rounded in bf16) into full-size steps: few elements only
            moved = (got[name] - ref).abs().gt(1e-2).float().mean().item()
            assert moved < 0.05, f"{name}: {moved:.1%} of elements moved with bf16 grads"


def test_bf16_parameter_communication_keeps_ranks_identical(reference, tmp_path):
    """--param-comm-dtype bfloat16 all-gathers rounded updates; every rank adds the same ones, so
    the weights stay bit-identical (the worker's checksum guard) and within rounding of fp32's."""
    out = tmp_path / "params.pt"
    proc = run_torchrun(3, [WORKER, "step", str(out)],
                        env_extra={"PARAM_COMM_DTYPE": "bfloat16", "GRAD_COMM_DTYPE": "bfloat16"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = torch.load(out)
    for name, ref in reference.items():
        if name.startswith("blocks."):
            torch.testing.assert_close(got[name], ref, rtol=0, atol=1e-3, msg=f"{name} moved with bf16 updates")
        else:
            moved = (got[name] - ref).abs().gt(1e-2).float().mean().item()
            assert moved < 0.05, f"{name}: {moved:.1%} of elements moved with bf16 updates"


def test_diverged_ranks_are_stopped_by_checksum_guard():
    proc = run_torchrun(2, [WORKER, "diverge"], timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "parameters diverged across ranks at step 7" in out
    assert "rank 1@" in out and "blocks.1.mlp.c_fc.weight" in out
    assert "parameters agree" not in out


def meta_optimizer() -> tuple[MuonAdamW, torch.nn.Parameter]:
    """A one-rank optimizer over a parameter on another device than the CPU ('meta' stands in for
    a GPU, which this machine lacks): where the optimizer puts its own tensors is then visible."""
    p = torch.nn.Parameter(torch.zeros(4, 3, device="meta"))
    return MuonAdamW([Group("adamw", "w", [p], lr=0.1)]), p


def test_loaded_optimizer_state_moves_to_the_parameters_device():
    """Checkpoints are read onto the CPU; on a CUDA run the state must land on the GPU."""
    opt, _ = meta_optimizer()
    state = {"exp_avg": torch.zeros(0), "exp_avg.0": torch.ones(4, 3), "exp_avg_sq.0": torch.ones(4, 3)}
    opt.load_state_dict({"step_count": 3, "world_size": 1, "rank": 0, "groups": {"w": state}})
    assert opt.step_count == 3
    assert {k: v.device.type for k, v in opt.groups[0].state.items()} == dict.fromkeys(state, "meta")


def test_adamw_step_counts_live_on_the_parameters_device(monkeypatch):
    """The fused AdamW kernel reads its step counts on the parameters' device (CUDA: not the CPU)."""
    seen = []
    monkeypatch.setattr(torch, "_fused_adamw_", lambda params, grads, m, v, _, steps, **kw: seen.append(
        {t.device.type for t in (*params, *grads, *m, *v, *steps)}))
    opt, p = meta_optimizer()
    p.grad = torch.zeros_like(p)
    opt.step()
    assert seen == [{"meta"}]


@pytest.mark.parametrize("shape", [(3, 64, 256), (3, 256, 64), (2, 48, 100)])
def test_newton_schulz_through_the_gram_matrix_equals_the_plain_iteration(shape, monkeypatch):
    """Wide matrices are orthogonalised on their small Gram matrix (optim.orthogonalize_via_gram):
    the same polynomial iteration, so the same result up to fp32 rounding, also for a gradient of
    low rank, whose small singular values the iteration amplifies most."""
    from nanochat_cpu import optim

    gen = torch.Generator().manual_seed(0)
    low_rank = torch.randn(shape[0], shape[1], 4, generator=gen) @ torch.randn(shape[0], 4, shape[2], generator=gen)
    full_rank = torch.randn(shape, generator=gen)
    for g in (full_rank, low_rank + 0.01 * torch.randn(shape, generator=gen)):
        via_gram = optim.orthogonalize(g, torch.float32)
        monkeypatch.setattr(optim, "GRAM_ASPECT", float("inf"))  # every matrix the plain way
        plain = optim.orthogonalize(g, torch.float32)
        monkeypatch.undo()
        assert (via_gram - plain).abs().max() <= 1e-3 * plain.abs().max()
    # the iteration's own promise for a full-rank gradient: singular values in roughly [0.7, 1.2]
    s = torch.linalg.svdvals(optim.orthogonalize(full_rank, torch.float32))
    assert s.min() > 0.5 and s.max() < 1.3
