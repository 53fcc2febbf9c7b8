"""Worker for the optimizer tests, run under torchrun (or alone for the 1-rank reference).

`step OUT [SIZES]`: two optimizer steps of a small GPT on a fixed global batch, each rank taking
its contiguous share of the rows (SIZES like "4,2": rows per rank, weighted by tokens as the
trainer does; default an even split); writes the final parameters to OUT (rank 0).
LOCAL_COMM=shm shares the optimizer's buffers in /dev/shm (the ranks are on one host), default gloo;
PRIVATE_GRADS=1 then takes the gradient targets away, so every gradient is copied into them.
DENSE_EMBEDDING_GRADS=1 gives the embedding tables dense gradients (the plain nn.Embedding way),
the reference for the optimizer's sparse rows. NO_GRAD=name,name drops those parameters' .grad
before the second step (which must not reuse what the first step's left behind); with
NO_GRAD_AS=zeros they get explicit zero gradients instead, the reference. SLOW_RANK=r: the backward
flags gradients as they complete, as in the trainer, and rank r starts its step only once the other
ranks have taken every work unit but the tables' (a rank slowed down by its machine); every rank
prints how many of the shared-memory step's units it did. BACKWARD_TWICE=1: a second forward and backward
follow the last one, which the shared-memory step must refuse. EXIT_RANK=r: rank r exits (status 0, so its
launcher does not stop the others) after its backward, leaving the others waiting for its rows.
`diverge`: perturb one parameter on the last rank, then run the cross-rank checksum guard.
"""

from __future__ import annotations

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from nanochat_cpu.config import TrainConfig
from nanochat_cpu.dist import DistEnv, Watchdog, check_parameters_agree
from nanochat_cpu.grad_target import set_grad_target
from nanochat_cpu.model import GPT, model_config_from
from nanochat_cpu.optim import build_optimizer
from nanochat_cpu.shm import make_arena

GLOBAL_ROWS, SEQ, VOCAB = 6, 32, 2000  # padded to 2,048 rows: some never get a gradient


def setup() -> DistEnv:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    env = DistEnv(rank=int(os.environ.get("RANK", "0")), world_size=world)
    if world > 1:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
        hosts: list = [None] * world
        dist.all_gather_object(hosts, env.host)
        env.hosts = hosts
    return env


def make_model(depth: int = 3) -> GPT:
    cfg = model_config_from(depth=depth, aspect_ratio=32, head_dim=32, vocab_size=VOCAB, seq_len=SEQ,
                            window_pattern="SL")
    model = GPT(cfg)
    model.init_weights(seed=1)
    # zero-initialised projections would make the first steps trivial: perturb them
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.02)
    return model


def step(out: str, split: str | None) -> None:
    if os.environ.get("DENSE_EMBEDDING_GRADS") == "1":
        GPT.embed = staticmethod(lambda table, idx: F.embedding(idx, table.weight))
    env = setup()
    torch.manual_seed(0)
    model = make_model()
    cfg = TrainConfig(weight_decay=0.1, grad_comm_dtype=os.environ.get("GRAD_COMM_DTYPE", "float32"),
                      param_comm_dtype=os.environ.get("PARAM_COMM_DTYPE", "float32"))
    arena = None
    if env.world_size > 1:
        arena, _ = make_arena(os.environ.get("LOCAL_COMM", "gloo"), env.rank, env.world_size, env.device, model)
    opt = build_optimizer(model, cfg, env.rank, env.world_size, torch.float32, arena)
    private_grads = os.environ.get("PRIVATE_GRADS") == "1"
    if private_grads:  # as a compiled model's: every gradient is autograd's own, copied over
        for p in model.parameters():
            set_grad_target(p, None)
    # Adam's eps=1e-10 turns gradients of ~1e-12 (summed in another order on N ranks) into
    # full-size steps of either sign; a larger eps keeps the comparison about the sharding.
    for g in opt.groups:
        g.eps = 1e-6
    gen = torch.Generator().manual_seed(3)
    for step_index in range(2):
        tokens = torch.randint(0, VOCAB, (GLOBAL_ROWS, SEQ + 1), generator=gen)
        sizes = [int(x) for x in split.split(",")] if split else [GLOBAL_ROWS // env.world_size] * env.world_size
        assert sum(sizes) == GLOBAL_ROWS and len(sizes) == env.world_size
        start = sum(sizes[: env.rank])
        mine = tokens[start:start + sizes[env.rank]]
        if os.environ.get("MICRO_ROWS"):  # gradient accumulation, the last backward syncing as it goes
            rows = int(os.environ["MICRO_ROWS"])
            chunks = mine.split(rows)
            for i, chunk in enumerate(chunks):
                opt.sync_in_backward = i == len(chunks) - 1
                loss = model(chunk[:, :-1], chunk[:, 1:])
                (loss * chunk.size(0) / GLOBAL_ROWS).backward()
            if env.world_size > 1 and opt.arena is None:  # every dense group's reduce is already on the wire
                assert all(g.pending for g in opt.groups if not g.sparse_rows), "hooks did not start the reduce"
        else:
            slow, twice = os.environ.get("SLOW_RANK"), os.environ.get("BACKWARD_TWICE") == "1"
            exit_rank = os.environ.get("EXIT_RANK")
            opt.sync_in_backward = slow is not None or twice or exit_rank is not None
            loss = model(mine[:, :-1], mine[:, 1:])
            (loss * sizes[env.rank] / GLOBAL_ROWS).backward()
            if twice:  # a second forward and backward inside the last micro-step
                (model(mine[:, :-1], mine[:, 1:]) * sizes[env.rank] / GLOBAL_ROWS).backward()
            if slow is not None and int(slow) == env.rank:
                wait_for_others_to_take_all_but_tables(opt)
            if exit_rank == str(env.rank):
                os._exit(0)
        if opt.arena is not None:
            assert_gradients_written_into_shared_memory(model, opt, expected=not private_grads)
        for name, p in model.named_parameters():
            if step_index == 1 and name in os.environ.get("NO_GRAD", "").split(","):
                p.grad = torch.zeros_like(p) if os.environ.get("NO_GRAD_AS") == "zeros" else None
        opt.step()
        if opt.arena is not None:
            tables = sum(u.group.sparse_rows for u in opt.units)
            print(f"units rank={env.rank} step={step_index} ran={opt.last_units_run} total={len(opt.units)} "
                  f"tables={tables}", flush=True)
        opt.zero_grad()
    if env.world_size > 1:  # bit-identical weights on every rank, or the guard stops the run
        check_parameters_agree(env, model, step=2, watchdog=Watchdog(env, 120))
    if env.rank == 0:
        torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, out)
    if env.world_size > 1:
        dist.destroy_process_group()


def wait_for_others_to_take_all_but_tables(opt) -> None:
    """Until every work unit but the tables' (whose rows this rank flags in its step) is taken."""
    units = [i for i, u in enumerate(opt.units) if not u.group.sparse_rows]
    deadline = time.monotonic() + 60
    while not (opt.claimed[units] == opt.step_count + 1).all():
        assert time.monotonic() < deadline, "the other ranks did not take the units this rank's gradients allow"
        time.sleep(0.01)


def assert_gradients_written_into_shared_memory(model: GPT, opt, expected: bool) -> None:
    """The LM head's and the blocks' matrices' gradients are each one's own place in this rank's
    shared buffer (written there by the loss and by the blocks' linear layers), not private
    tensors copied over; or, not `expected`, all of them private."""
    places = {id(p): view for g in opt.groups if not g.sparse_rows
              for p, view in zip(g.params, g.grad_views, strict=True)}
    weights = [("lm_head.weight", model.lm_head.weight)] + [
        (n, p) for n, p in model.blocks.named_parameters() if p.dim() == 2]
    private = [n for n, p in weights if p.grad is None or p.grad.data_ptr() != places[id(p)].data_ptr()]
    assert len(weights) > 10
    if expected:
        assert not private, f"gradients outside their place in shared memory: {private}"
    else:
        assert len(private) == len(weights), "gradients in shared memory although no target was set"


def diverge() -> None:
    env = setup()
    model = make_model()
    if env.rank == env.world_size - 1:
        with torch.no_grad():
            model.blocks[1].mlp.c_fc.weight[0, 0] += 1e-3
    check_parameters_agree(env, model, step=7, watchdog=Watchdog(env, 120))
    print(f"rank {env.rank}: parameters agree", flush=True)


if __name__ == "__main__":
    {"step": lambda: step(sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None), "diverge": diverge}[sys.argv[1]]()
