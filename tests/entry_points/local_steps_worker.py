"""Worker for the local-steps tests: one rank of a node (a torchrun launcher), or alone the 1-node reference.

`identical OUT H`: every node trains on the same batches (its ranks splitting them), STEPS inner
steps, an outer sync every H steps and after the last, outer lr 1 and momentum 0; rank 0 writes
the initial parameters to OUT with the suffix .start.pt and the final ones to OUT. Alone (no
torchrun) the same steps on one process: the reference.
`weighted OUT ROWS`: node n takes ROWS[n] rows of each global batch (different data on every node),
two inner steps per outer step, two outer steps at outer lr 0.7 and Nesterov momentum 0.9;
each node's first rank writes its parameters before each outer step (OUT/node{n}.{k}.pt) and
rank 0 theta_global before and after each (OUT/global.{k}.pt), for the test to recompute.
`diverge`: one inner step and an outer step, then the last node's theta_global is nudged; the
cross-rank checksum the trainer runs after every outer step must stop every rank.
`overlapped OUT ROWS`: as `weighted`, over three phases, the first two outer steps overlapped (each
lands at the next), the last one not; each node's first rank writes its parameters before each
outer step (OUT/node{n}.{k}.pt), rank 0 the initial and final ones (OUT/global.0.pt, global.3.pt).
`overlapped-mid OUT ROWS`: the same, each overlapped sync landing mid-phase, one inner step after
it left; each node's first rank also writes its parameters just before and after the landing
(OUT/node{n}.{k}.mid.pt, OUT/node{n}.{k}.landed.pt).
`diverge-overlapped`: the last node's theta_global is nudged before an overlapped outer step (bf16
updates, which every leader adds to its own theta): the sync's thread must stop every rank.
LOCAL_COMM=auto|gloo: the node's ranks share memory (where there are two) or step through Gloo.
OVERLAP=1 (`identical`): every outer step but the last overlaps the next phase, and lands one
inner step later (at the next boundary where H is 1).
COMPRESS=int8|int4: the outer syncs travel quantized, with error feedback (`weighted` then also
writes each node's first rank's outer state after each outer step: OUT/state{n}.{k}.pt);
EXACT_LAST=1 sends `weighted`'s last one exactly, as a run's last.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from nanochat_cpu.config import TrainConfig
from nanochat_cpu.dist import Watchdog, check_parameters_agree
from nanochat_cpu.optim import build_optimizer
from nanochat_cpu.outer_codec import codec_named
from nanochat_cpu.shm import make_arena
from nanochat_cpu.sync_diloco import DiLoCo, find_nodes, open_background
from tests.entry_points.dist_worker import GLOBAL_ROWS, SEQ, VOCAB, make_model, setup

STEPS = 4
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9  # `weighted`: DiLoCo's published outer step, momentum and all


def build(outer_lr: float, outer_momentum: float, rows: list[int], overlap: bool = False,
          param_dtype: torch.dtype = torch.float32):
    """The model, the node's inner optimizer and the outer one (None alone), and this rank's slice
    of a global batch of sum(rows) rows: its node's rows, shared evenly by the node's ranks."""
    env = setup()
    torch.manual_seed(0)
    model = make_model()
    cfg = TrainConfig(weight_decay=0.1)
    if env.world_size == 1:
        opt = build_optimizer(model, cfg, 0, 1, torch.float32)
        diloco, share = None, slice(0, sum(rows))
    else:
        watchdog = Watchdog(env, 120)
        nodes = find_nodes(env, watchdog)
        if overlap:
            nodes.background = open_background(env, nodes, watchdog, 120)
        arena, _ = make_arena(os.environ.get("LOCAL_COMM", "auto"), nodes.rank_in_node, nodes.size, env.device,
                              model, nodes.group)
        opt = build_optimizer(model, cfg, nodes.rank_in_node, nodes.size, torch.float32, arena, nodes.group)
        node_rows = rows[nodes.index] if len(rows) == nodes.count else rows[0]
        start = sum(rows[: nodes.index]) if len(rows) == nodes.count else 0
        per_rank = node_rows // nodes.size
        share = slice(start + nodes.rank_in_node * per_rank, start + (nodes.rank_in_node + 1) * per_rank)
        weight = node_rows / (sum(rows) if len(rows) == nodes.count else node_rows * nodes.count)
        diloco = DiLoCo(model, nodes, weight, outer_lr, outer_momentum, torch.float32, param_dtype,
                        shared_params=arena is not None, codec=codec_named(os.environ.get("COMPRESS", "none")))
    for g in opt.groups:
        # tiny gradients summed in another order stay small steps: at 1e-6 one embedding entry of
        # 2 nodes of 2 ranks landed 4.3e-5 from one node alone on a Zen 4; at 1e-5 every entry is within 1e-5
        g.eps = 1e-5
    return env, model, opt, diloco, share


def inner_step(model, opt, tokens: torch.Tensor, share: slice, node_rows: int) -> None:
    mine = tokens[share]
    loss = model(mine[:, :-1], mine[:, 1:])
    (loss * mine.size(0) / node_rows).backward()
    opt.step()
    opt.zero_grad()


def save(model, path: Path) -> None:
    torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, path)


def identical(out: str, every: int) -> None:
    rows = [GLOBAL_ROWS]  # every node the same rows
    env, model, opt, diloco, share = build(1.0, 0.0, rows, overlap=os.environ.get("OVERLAP") == "1")
    if env.rank == 0:
        save(model, Path(out).with_suffix(".start.pt"))
    gen = torch.Generator().manual_seed(3)
    for step in range(1, STEPS + 1):
        inner_step(model, opt, torch.randint(0, VOCAB, (GLOBAL_ROWS, SEQ + 1), generator=gen), share, GLOBAL_ROWS)
        boundary = step % every == 0 or step == STEPS
        if diloco is not None and diloco.lands_at == step and not boundary:
            diloco.land()
        if diloco is not None and boundary:
            overlap = diloco.overlaps and step < STEPS
            diloco.outer_step(0.0, step, overlap, land_at=step + 1 if overlap and every > 1 else None)
    if env.rank == 0:
        save(model, Path(out))


def weighted(out: str, rows_arg: str) -> None:
    rows = [int(r) for r in rows_arg.split(",")]
    env, model, opt, diloco, share = build(OUTER_LR, OUTER_MOMENTUM, rows)
    node_rows = rows[diloco.nodes.index]
    gen = torch.Generator().manual_seed(3)
    for k in range(2):
        if env.rank == 0:
            save(model, Path(out) / f"global.{k}.pt")
        for _ in range(2):
            inner_step(model, opt, torch.randint(0, VOCAB, (sum(rows), SEQ + 1), generator=gen), share, node_rows)
        if diloco.nodes.leader:
            save(model, Path(out) / f"node{diloco.nodes.index}.{k}.pt")
        diloco.outer_step(0.0, exact=k == 1 and os.environ.get("EXACT_LAST") == "1")
        if diloco.nodes.leader:
            torch.save(diloco.state_dict(), Path(out) / f"state{diloco.nodes.index}.{k}.pt")
    if env.rank == 0:
        save(model, Path(out) / "global.2.pt")
    check_parameters_agree(env, model, 4, Watchdog(env, 120))


def diverge() -> None:
    env, model, opt, diloco, share = build(TrainConfig.outer_lr, TrainConfig.outer_momentum, [GLOBAL_ROWS])
    gen = torch.Generator().manual_seed(3)
    inner_step(model, opt, torch.randint(0, VOCAB, (GLOBAL_ROWS, SEQ + 1), generator=gen), share, GLOBAL_ROWS)
    diloco.outer_step(0.0)
    if diloco.nodes.index == diloco.nodes.count - 1 and diloco.nodes.leader:
        with torch.no_grad():
            model.blocks[1].mlp.c_fc.weight[0, 0] += 1e-3
    dist.barrier()  # the shared weights changed before anyone sums them
    check_parameters_agree(env, model, 1, Watchdog(env, 120))
    print(f"rank {env.rank}: parameters agree", flush=True)


def overlapped(out: str, rows_arg: str, mid: bool = False) -> None:
    rows = [int(r) for r in rows_arg.split(",")]
    env, model, opt, diloco, share = build(OUTER_LR, OUTER_MOMENTUM, rows, overlap=True)
    node_rows = rows[diloco.nodes.index]
    gen = torch.Generator().manual_seed(3)
    if env.rank == 0:
        save(model, Path(out) / "global.0.pt")
    for k in range(3):
        for i in range(2):
            inner_step(model, opt, torch.randint(0, VOCAB, (sum(rows), SEQ + 1), generator=gen), share, node_rows)
            if i == 0 and diloco.lands_at == 2 * k + 1:
                name = f"node{diloco.nodes.index}.{k - 1}"
                if diloco.nodes.leader:
                    save(model, Path(out) / f"{name}.mid.pt")
                diloco.land()
                if diloco.nodes.leader:
                    save(model, Path(out) / f"{name}.landed.pt")
        if diloco.nodes.leader:
            save(model, Path(out) / f"node{diloco.nodes.index}.{k}.pt")
        outer = diloco.outer_step(0.0, 2 * k + 2, overlap=k < 2, land_at=2 * k + 3 if mid and k < 2 else None)
        assert outer.overlapped == (k < 2)
    if env.rank == 0:
        save(model, Path(out) / "global.3.pt")
    check_parameters_agree(env, model, 6, Watchdog(env, 120))


def diverge_overlapped() -> None:
    env, model, opt, diloco, share = build(TrainConfig.outer_lr, TrainConfig.outer_momentum, [GLOBAL_ROWS],
                                           overlap=True, param_dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(3)
    for step in (1, 2):
        inner_step(model, opt, torch.randint(0, VOCAB, (GLOBAL_ROWS, SEQ + 1), generator=gen), share, GLOBAL_ROWS)
        if step == 2 and diloco.nodes.index == diloco.nodes.count - 1 and diloco.nodes.leader:
            diloco.flight.join()  # the first sync's thread is done with theta
            diloco.theta[0] += 1e-3  # the bf16 updates are added to it: the nudge stays
        diloco.outer_step(0.0, step, overlap=True)
    diloco.outer_step(0.0, 3)  # lands the second: its thread stopped every rank before
    print(f"rank {env.rank}: theta_global agrees", flush=True)


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "identical":
        identical(sys.argv[2], int(sys.argv[3]))
    elif mode == "weighted":
        weighted(sys.argv[2], sys.argv[3])
    elif mode in ("overlapped", "overlapped-mid"):
        overlapped(sys.argv[2], sys.argv[3], mid=mode == "overlapped-mid")
    elif mode == "diverge-overlapped":
        diverge_overlapped()
    else:
        diverge()
    if dist.is_initialized():  # every rank done before the groups go: torn down at exit, Gloo aborts
        dist.barrier()
        dist.destroy_process_group()
