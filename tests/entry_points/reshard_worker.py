"""Worker for test_reshard: train, save every rank's optimizer shard, resume at another world size.

`train DIR`: STEPS steps of a small GPT, each rank taking its share of a fixed global batch; saves
the parameters (model.pt) and every rank's optimizer shard (rank{r}.pt) after them, then takes one
step more and saves the parameters again (uninterrupted.pt).
`resume DIR OUT`: from DIR's parameters and the merge of all its shards, the same step more at this
world size and strategy; saves the parameters to OUT.
LOCAL_COMM as in dist_worker: shm shares the optimizer's buffers in /dev/shm (one host), gloo not.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from nanochat_cpu.config import TrainConfig
from nanochat_cpu.dist import DistEnv
from nanochat_cpu.optim import MuonAdamW, build_optimizer, merge_optimizer_states
from nanochat_cpu.shm import make_arena
from tests.entry_points.dist_worker import GLOBAL_ROWS, SEQ, VOCAB, make_model, setup

STEPS = 2  # before the checkpoint


def build(env: DistEnv) -> tuple[torch.nn.Module, MuonAdamW, Path]:
    model = make_model(depth=2)
    saved = Path(sys.argv[2])
    if (saved / "model.pt").exists():  # resuming: the optimizer takes the parameters it is built over
        params = torch.load(saved / "model.pt", weights_only=True)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(params[name])
    arena = None
    if env.world_size > 1:
        arena, _ = make_arena(os.environ.get("LOCAL_COMM", "gloo"), env.rank, env.world_size, env.device, model)
    opt = build_optimizer(model, TrainConfig(weight_decay=0.1), env.rank, env.world_size, torch.float32, arena)
    for g in opt.groups:  # as in dist_worker: rounding-sized gradients stay rounding-sized steps
        g.eps = 1e-6
    return model, opt, saved


def train_step(env: DistEnv, model: torch.nn.Module, opt: MuonAdamW, step: int) -> None:
    """Step `step` on its global batch, whatever the world size: the rows split evenly."""
    tokens = torch.randint(0, VOCAB, (GLOBAL_ROWS, SEQ + 1), generator=torch.Generator().manual_seed(100 + step))
    rows = GLOBAL_ROWS // env.world_size
    mine = tokens[env.rank * rows: (env.rank + 1) * rows]
    loss = model(mine[:, :-1], mine[:, 1:])
    (loss * rows / GLOBAL_ROWS).backward()
    opt.step()
    opt.zero_grad()


def save_parameters(env: DistEnv, model: torch.nn.Module, path: Path) -> None:
    if env.rank == 0:
        torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, path)


def train() -> None:
    env = setup()
    model, opt, out = build(env)
    for step in range(STEPS):
        train_step(env, model, opt, step)
    torch.save(opt.state_dict(), out / f"rank{env.rank}.pt")
    save_parameters(env, model, out / "model.pt")
    train_step(env, model, opt, STEPS)
    save_parameters(env, model, out / "uninterrupted.pt")


def resume() -> None:
    env = setup()
    model, opt, saved = build(env)
    shards = [torch.load(saved / f"rank{r}.pt", weights_only=True) for r in range(len(list(saved.glob("rank*.pt"))))]
    opt.load_state_dict(merge_optimizer_states(shards))
    assert opt.step_count == STEPS
    train_step(env, model, opt, STEPS)
    save_parameters(env, model, Path(sys.argv[3]))


if __name__ == "__main__":
    {"train": train, "resume": resume}[sys.argv[1]]()
    if dist.is_initialized():
        dist.destroy_process_group()
