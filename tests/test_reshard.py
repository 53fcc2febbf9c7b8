"""The optimizer state at any layout: every rank's shard merged into the whole state, and the
whole state loaded by any rank of any world size and strategy (optim.merge_optimizer_states).

The pure tests build the ranks of one optimizer world side by side in this process: ZeRO-2's
strategy only communicates in step(), and the shared-memory one is given a private arena (its
"shared" tensors are then each rank's own, which is all its checkpointing reads). The real runs
train on torchrun + Gloo, resume at other world sizes and strategies, and step on."""

from __future__ import annotations

import contextlib
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from nanochat_cpu.optim import MuonAdamW, merge_optimizer_states
from nanochat_cpu.sync_strategy import Group
from tests.trainer_runs import ENTRY_POINTS, REPO, node_env, run_torchrun

WORKER = str(ENTRY_POINTS / "reshard_worker.py")

# items per group: 10 table rows, 11 scalars, 5 matrices; none divisible by 3 or 4, so the last
# slices are padded, and at 4 ranks the last rank owns no matrix at all
TABLES, DENSE, MATRICES = [(7, 4), (3, 4)], [(5,), (3, 2)], [(4, 3)] * 5


def make_groups() -> list[Group]:
    gen = torch.Generator().manual_seed(0)

    def params(shapes: list[tuple[int, ...]]) -> list[torch.nn.Parameter]:
        return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]

    return [Group("adamw", "table", params(TABLES), lr=0.1, sparse_rows=True),
            Group("adamw", "dense", params(DENSE), lr=0.1),
            Group("muon", "matrix", params(MATRICES), lr=0.1)]


class PrivateArena:
    """A SharedArena whose tensors only this process maps (no process group needed to make them)."""

    @staticmethod
    def tensor(_name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype)

    @staticmethod
    def lock(_name: str, _what: str, _step) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


@pytest.fixture(scope="module")
def one_process_group():
    """The shared-memory strategy ends its setup with a barrier: a process group of this process."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def world(size: int, strategy: str) -> list[MuonAdamW]:
    """Every rank of one optimizer world, each over its own copy of the parameters."""
    arena = PrivateArena() if strategy == "shared" else None
    opts = [MuonAdamW(make_groups(), rank, size, arena=arena) for rank in range(size)]
    assert {opt.sync.name for opt in opts} == {strategy if size > 1 else "local"}
    return opts


def stepped_local_state() -> dict:
    """One process's state after two steps on random gradients: every key with real values."""
    opt = MuonAdamW(make_groups())
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        for g in opt.groups:
            for p in g.params:
                if g.sparse_rows:  # the table's own gradient buffer, as the backward fills it
                    p.grad.copy_(torch.randn(p.shape, generator=gen))
                else:
                    p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
        opt.zero_grad()
    return opt.state_dict()


def assert_same_whole(got: dict, want: dict) -> None:
    assert got["step_count"] == want["step_count"]
    assert got["groups"].keys() == want["groups"].keys()
    for name, state in want["groups"].items():
        assert got["groups"][name].keys() == state.keys(), name
        for key, tensor in state.items():
            assert torch.equal(got["groups"][name][key], tensor), f"{name}.{key} changed"


@pytest.mark.parametrize("strategy", ["zero2", "shared"])
def test_whole_state_survives_every_world_size(strategy, one_process_group):
    """1 process -> 3 ranks -> 4 -> 2 -> 1 process: the shards merge back into the same whole state,
    bit for bit, and the one process ends with the very tensors it started from."""
    local = stepped_local_state()
    whole = merge_optimizer_states([local])
    assert whole["groups"]["table"]["exp_avg"].shape == (10, 4)
    assert whole["groups"]["dense"]["exp_avg_sq"].shape == (11,)
    assert whole["groups"]["matrix"]["momentum"].shape == (5, 4, 3)
    assert all(t.abs().sum() > 0 for state in whole["groups"].values() for t in state.values())
    for size in (3, 4, 2):
        opts = world(size, strategy)
        for opt in opts:
            opt.load_state_dict(whole)
        shards = [opt.state_dict() for opt in opts]
        assert_same_whole(merge_optimizer_states(shards), whole)
        again = world(size, strategy)  # the own shard at an unchanged layout: taken as it is
        for opt, shard in zip(again, shards, strict=True):
            opt.load_state_dict(shard)
            for name, state in opt.state_dict()["groups"].items():
                assert all(torch.equal(t, shard["groups"][name][k]) for k, t in state.items())
    (one,) = world(1, strategy)
    one.load_state_dict(whole)
    back = one.state_dict()
    for name, state in local["groups"].items():
        assert back["groups"][name].keys() == state.keys()
        assert all(torch.equal(back["groups"][name][k], t) for k, t in state.items()), name


def test_slices_are_padded_and_a_rank_without_matrices_may_save_none():
    """Rank 2 of 3 holds scalars 8..10 and one zero of padding, table rows 8..9 and two of padding.
    Rank 3 of 4 owns no matrix (ZeRO-2, stepping, then saves no momentum for it): the merge reads
    zeros where a shard has none."""
    whole = merge_optimizer_states([stepped_local_state()])
    opts = world(3, "zero2")
    for opt in opts:
        opt.load_state_dict(whole)
    dense = opts[2].state_dict()["groups"]["dense"]["exp_avg.0"]
    assert torch.equal(dense[:3], whole["groups"]["dense"]["exp_avg"][8:]) and dense[3] == 0
    table = opts[2].state_dict()["groups"]["table"]["exp_avg_sq.0"]
    assert torch.equal(table[:2], whole["groups"]["table"]["exp_avg_sq"][8:]) and not table[2:].any()
    opts = world(4, "zero2")
    for opt in opts:
        opt.load_state_dict(whole)
    shards = [opt.state_dict() for opt in opts]
    assert not shards[3]["groups"]["matrix"]["momentum"].any()
    del shards[3]["groups"]["matrix"]["momentum"]
    assert_same_whole(merge_optimizer_states(shards), whole)


def test_a_fresh_optimizer_merges_to_zeros_and_the_whole_state_loads_with_weights_only(tmp_path):
    """Before its first step ZeRO-2 keeps no state: the whole state is zeros, as a fresh one is;
    it holds only what torch.load(weights_only=True) reads."""
    whole = merge_optimizer_states([opt.state_dict() for opt in world(3, "zero2")])
    assert all(not t.any() for state in whole["groups"].values() for t in state.values())
    torch.save(merge_optimizer_states([stepped_local_state()]), tmp_path / "whole.pt")
    loaded = torch.load(tmp_path / "whole.pt", weights_only=True)
    (one,) = world(1, "zero2")
    one.load_state_dict(loaded)
    assert one.step_count == 2


def shards_of(size: int) -> list[dict]:
    opts = world(size, "zero2")
    whole = merge_optimizer_states([stepped_local_state()])
    for opt in opts:
        opt.load_state_dict(whole)
    return [opt.state_dict() for opt in opts]


def test_merge_refuses_shards_that_do_not_make_one_whole():
    shards = shards_of(3)
    with pytest.raises(ValueError, match=r"\(rank, world size\) \[\(0, 3\), \(2, 3\)\]: merging needs every rank"):
        merge_optimizer_states([shards[0], shards[2]])
    with pytest.raises(ValueError, match="every rank 0..n-1 of one world"):
        merge_optimizer_states([shards[1], shards[0], shards[2]])
    with pytest.raises(ValueError, match="every rank 0..n-1 of one world"):
        merge_optimizer_states([shards[0], *shards_of(2)[1:], shards[2]])
    late = dict(shards[1], step_count=3)
    with pytest.raises(ValueError, match=r"differ in step_count \(by rank: \[2, 3, 2\]\)"):
        merge_optimizer_states([shards[0], late, shards[2]])
    other = dict(shards[2], layouts={**shards[2]["layouts"], "dense": {**shards[2]["layouts"]["dense"], "items": 12}})
    with pytest.raises(ValueError, match=r"ranks 0 and 2 differ in the layouts of groups \['dense'\]"):
        merge_optimizer_states([shards[0], shards[1], other])
    torn = dict(shards[1], groups={**shards[1]["groups"], "matrix": {"momentum": torch.zeros(3, 4, 3)}})
    with pytest.raises(ValueError, match=r"matrix: rank 1's momentum has shape \(3, 4, 3\), .* needs \(2, 4, 3\)"):
        merge_optimizer_states([shards[0], torn, shards[2]])
    lacking = dict(shards[0], groups={k: v for k, v in shards[0]["groups"].items() if k != "table"})
    with pytest.raises(ValueError, match=r"shards of ranks \[0\] lack group table"):
        merge_optimizer_states([lacking, *shards[1:]])
    old = {k: v for k, v in shards[0].items() if k != "layouts"}
    with pytest.raises(ValueError, match="saved without their layouts"):
        merge_optimizer_states([old, *shards[1:]])
    with pytest.raises(ValueError, match="no optimizer shards"):
        merge_optimizer_states([])


def test_load_refuses_what_does_not_fit_this_model():
    whole = merge_optimizer_states([stepped_local_state()])
    (opt,) = world(1, "zero2")
    wide = dict.fromkeys(("exp_avg", "exp_avg_sq"), torch.zeros(10, 5))
    wider = {**whole, "groups": {**whole["groups"], "table": wide}}
    with pytest.raises(ValueError, match=r"state of group table holds .*\(10, 5\).*needs .*\(10, 4\)"):
        opt.load_state_dict(wider)
    fewer = {**whole, "groups": {k: v for k, v in whole["groups"].items() if k != "matrix"}}
    with pytest.raises(ValueError, match=r"groups \['dense', 'table'\], this model's optimizer \['dense', 'matrix'"):
        opt.load_state_dict(fewer)
    assert opt.step_count == 0, "a refused state is not half loaded"
    shard = shards_of(2)[1]
    with pytest.raises(ValueError, match="saved by rank 1 of 2, this is rank 0 of 1: load the whole state"):
        opt.load_state_dict(shard)
    (second,) = world(2, "zero2")[1:]
    moved = dict(shard, layouts={**shard["layouts"], "matrix": {**shard["layouts"]["matrix"], "items": 6}})
    with pytest.raises(ValueError, match=r"shard's groups \['matrix'\] are laid out differently"):
        second.load_state_dict(moved)


# ---- real runs: train at 2 ranks, resume at 3 and at 1 from the merged state ------------------------

def worker(mode: str, world_size: int, local_comm: str, *args: str) -> None:
    cmd = [WORKER, mode, *args]
    env = {"LOCAL_COMM": local_comm}
    if world_size == 1:
        proc = subprocess.run([sys.executable, *cmd], env={**node_env(), **env}, capture_output=True, text=True,
                              timeout=120, cwd=REPO)
    else:
        proc = run_torchrun(world_size, cmd, env_extra=env, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize(("saved_with", "resumed_with"), [("gloo", [(3, "shm"), (1, "")]),
                                                          ("shm", [(3, "gloo"), (1, "")])])
def test_resume_at_another_world_size_and_strategy_steps_on_as_uninterrupted(saved_with, resumed_with, tmp_path):
    """2 ranks (ZeRO-2 through Gloo, or sharing memory on one host) train 2 steps and save every
    rank's shard, then take a third step: the reference. Resumed from the merged shards by 3 ranks
    of the other strategy (Gloo stands in for ranks on several hosts: make_arena picks it there)
    and by 1 process, the same third step on the same global batch gives the same parameters.

    Not bit for bit: 3 ranks sum a gradient of 3 parts, 1 rank of 1, in another order than 2
    ranks; the fp32 rounding (~1e-7 relative) is what moves. The tolerances are test_dist_optim's
    for N ranks against 1 (the worker's Adam eps 1e-6 keeps rounding-sized gradients from turning
    into full-size steps), after one step on an identical state: a wrong slice of the moments
    moves a parameter by the learning rate's order, 1e-3 and more."""
    worker("train", 2, saved_with, str(tmp_path))
    want = torch.load(tmp_path / "uninterrupted.pt")
    for size, local_comm in resumed_with:
        out = tmp_path / f"resumed{size}.pt"
        worker("resume", size, local_comm, str(tmp_path), str(out))
        got = torch.load(out)
        assert got.keys() == want.keys() and len(want) > 5
        for name, ref in want.items():
            torch.testing.assert_close(got[name], ref, rtol=1e-4, atol=2e-5,
                                       msg=f"{name} differs resumed at {size} ({local_comm or 'one process'})")
