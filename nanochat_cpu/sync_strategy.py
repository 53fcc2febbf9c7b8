"""How an optimizer step reaches every rank: the interface of the optimizer's sync strategies.

`MuonAdamW` (optim.py) does the update math; a strategy decides where gradients, parameters and
optimizer state live and what crosses between ranks around that math:

- `LocalSync` (sync_local.py): one process, nothing to communicate;
- `Zero2Sync` (sync_zero2.py): ranks through the process group (Gloo), ZeRO-2: reduce-scatter
  the gradients, each rank updates the slice it owns, all-gather the parameters;
- `SharedMemorySync` (sync_shared.py): every rank on one host, buffers in shared memory, a
  queue of work units that any rank takes.

A strategy is built once the groups are final (it may turn parameters into views of its own
buffers and register gradient hooks on them) and then sees only these calls:

    step()           gradients in, the update (through the optimizer's adamw/muon), parameters out
    zero_grad()      ready the gradients for the next step
    load_state(g, s) put a checkpointed shard of group g's optimizer state back

and, for a checkpoint resumed at another world size or with another strategy, the conversions
between its shards and a group's whole state (`WHOLE_KEYS`, the unpadded items; optim.py's
`merge_optimizer_states`):

    whole_of_shards(name, layout, shards)   every rank's saved shard of a group -> the whole state
    shard_of_whole(g, whole)                the whole state -> the shard this rank keeps

plus `phase`, the watchdog's name for what step() waits on, and `comm_wait`, the seconds the last
step spent blocked on communication. The ranks a strategy spans are the optimizer's `group`: the
world, or with local steps (sync_diloco.py) one node's ranks, the nodes meeting only in an outer
step every few inner steps.

The rest of this module is what the strategies that cut groups into per-rank slices share: the
flat-buffer layout of a group, and putting a parameter's gradient into its place in a buffer.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist

from .perf import sync

# ---- what a strategy and the optimizer share ------------------------------------------------------

@dataclass
class Group:
    """A parameter group: its hyperparameters, and the optimizer state this rank keeps of it."""

    kind: str  # "adamw" or "muon"
    name: str
    params: list[torch.nn.Parameter]
    lr: float
    betas: tuple[float, float] = (0.8, 0.95)
    eps: float = 1e-10
    momentum: float = 0.95
    weight_decay: float = 0.0
    sparse_rows: bool = False  # embedding tables: only the rows of tokens seen get gradients
    lr_multiplier: float = 1.0  # set by the schedule each step
    # the optimizer state this rank keeps and checkpoints: of its slice with N ranks
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    # set by the sync strategy, and what the tests see of it: each parameter's place in the
    # strategy's gradient buffer (where it keeps one), and the group's communication still in
    # flight (a reduce started from the backward's hooks)
    grad_views: list[torch.Tensor] = field(default_factory=list)
    pending: list = field(default_factory=list)

    def adamw_state(self, params: list[torch.Tensor],
                    keep_in: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The moments of a list of tensors (the owned slice with N ranks, the parameters with 1),
        made on first use as zeros, or `keep_in` the given (first, second moment) tensors."""
        if "exp_avg" not in self.state:
            for i, p in enumerate(params):
                m, v = keep_in[i] if keep_in else (torch.zeros_like(p), torch.zeros_like(p))
                self.state[f"exp_avg.{i}"], self.state[f"exp_avg_sq.{i}"] = m, v
            self.state["exp_avg"] = torch.zeros(0)  # marker: state initialised
        return ([self.state[f"exp_avg.{i}"] for i in range(len(params))],
                [self.state[f"exp_avg_sq.{i}"] for i in range(len(params))])


class Optimizer(Protocol):
    """What a strategy reads and calls of the optimizer it serves (optim.MuonAdamW): its groups,
    the ranks that step together, and the update math. A protocol, so the strategies need not
    import the optimizer that imports them."""

    groups: list[Group]
    params: list[torch.nn.Parameter]
    device: torch.device
    rank: int
    world_size: int
    group: dist.ProcessGroup | None  # the ranks that step together (None: the world)
    step_count: int
    sync_in_backward: bool

    def adamw(self, g: Group, params: list[torch.Tensor], grads: list[torch.Tensor], m: list[torch.Tensor],
              v: list[torch.Tensor]) -> None: ...

    def muon(self, g: Group, params: torch.Tensor | list[torch.Tensor], grads: torch.Tensor,
             mom: torch.Tensor) -> None: ...


# A group's whole optimizer state, whatever strategy kept it: each tensor (items, *item) as in
# FlatLayout (all elements of a dense AdamW group, all rows of a table group, all matrices of a
# Muon group), in the order of the group's parameters, without padding
WHOLE_KEYS = {"muon": ("momentum",), "adamw": ("exp_avg", "exp_avg_sq")}


class SyncStrategy:
    """The interface `MuonAdamW` delegates to; subclasses implement step and zero_grad, and the
    conversions of their checkpointed state."""

    phase = "optimizer step"  # the watchdog's name for a step() that hangs or fails
    name = ""  # how a checkpoint names the strategy that saved it

    def __init__(self, opt: Optimizer):
        self.opt = opt  # its groups, step count and sync_in_backward flag; its adamw and muon updates
        self.comm_wait = 0.0  # seconds the last step spent blocked on communication (zeroed by the optimizer)

    def step(self) -> None:
        raise NotImplementedError

    def zero_grad(self) -> None:
        raise NotImplementedError

    def load_state(self, g: Group, saved: dict[str, torch.Tensor]) -> None:
        """Take a group's checkpointed state (read onto the CPU) as it is, on the parameters' device."""
        g.state = {k: v.to(self.opt.device, copy=True) for k, v in saved.items()}

    @staticmethod
    def whole_of_shards(name: str, layout: dict, shards: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Group `name`'s whole state (WHOLE_KEYS) from every rank's saved shard of it, in rank
        order; `layout` is the group's `layout_record` as saved. Zeros where nothing was saved
        yet (state is made on first use): the same as a fresh state."""
        raise NotImplementedError

    def shard_of_whole(self, g: Group, whole: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The part of a group's whole state (checked to fit) this rank keeps, as its own state
        names it: what load_state takes."""
        raise NotImplementedError


# ---- waiting on the wire: what the strategies that communicate share ------------------------------

# torch 2.13 renamed the tensor collectives (the old names warn); older torch has only the old ones
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# the dtypes --grad-comm-dtype and --param-comm-dtype name
WIRE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def wait_timed(work: dist.Work, device: torch.device) -> float:
    """Block until a collective is complete; the seconds it blocked. On CUDA, Work.wait() only
    makes the compute stream wait, so the host synchronises too: otherwise the wait would surface,
    unmeasured, in whatever synchronises next."""
    sync(device)  # the kernels queued before it are compute, not waiting
    t0 = time.perf_counter()
    work.wait()
    sync(device)
    return time.perf_counter() - t0


# ---- a group as one flat buffer cut into equal per-rank slices --------------------------------

@dataclass
class FlatLayout:
    """Where a group's parameters live in a flat buffer of `items`: one element (dense AdamW),
    one table row (sparse AdamW) or one matrix (Muon). Each rank owns `shard` consecutive items
    (the last slices padded: any world size works, no divisibility of the vocabulary)."""

    item: tuple[int, ...]
    numel: int  # items
    shard: int  # items per rank
    world_size: int
    offsets: list[int] = field(default_factory=list)  # each parameter's first element in the buffer

    @classmethod
    def of(cls, g: Group, world_size: int) -> FlatLayout:
        p0 = g.params[0]
        if g.kind == "muon":
            item, numel = tuple(p0.shape), len(g.params)
        elif g.sparse_rows:
            item, numel = tuple(p0.shape[1:]), sum(p.shape[0] for p in g.params)
        else:
            item, numel = (), sum(p.numel() for p in g.params)
        offsets, start = [], 0
        for p in g.params:
            offsets.append(start)
            start += p.numel()
        return cls(item, numel, -(-numel // world_size), world_size, offsets)

    @property
    def item_numel(self) -> int:
        return math.prod(self.item)

    @property
    def shape(self) -> tuple[int, ...]:
        """The buffer's shape: every rank's slice, padding included."""
        return (self.shard * self.world_size, *self.item)

    def owned(self, rank: int) -> int:
        """How many real items (not padding) `rank`'s slice holds."""
        return max(0, min(self.shard, self.numel - rank * self.shard))


def layout_record(g: Group, world_size: int) -> dict:
    """What a checkpoint records of a group's layout, so that its shards can be read without the
    model: only ints, strings and lists (a canonical state loads with weights_only=True)."""
    layout = FlatLayout.of(g, world_size)
    return {"kind": g.kind, "item": list(layout.item), "items": layout.numel, "shard": layout.shard,
            "params": [list(p.shape) for p in g.params]}


def checked_part(name: str, key: str, part: torch.Tensor | None, shape: tuple[int, ...], where: str,
                 ) -> torch.Tensor | None:
    """A saved tensor of a group's state, refused (ValueError) unless it has the layout's shape."""
    if part is not None and tuple(part.shape) != shape:
        raise ValueError(f"optimizer state of group {name}: {where} {key} has shape {tuple(part.shape)}, "
                         f"its recorded layout needs {shape}: the shards do not fit together")
    return part


class SlicedState(SyncStrategy):
    """A strategy whose ranks each checkpoint a static slice of every group's state: rank r the
    items [r * shard, (r + 1) * shard) of its FlatLayout, the last slices padded with zeros;
    Muon's as "momentum", AdamW's as "exp_avg.0" and "exp_avg_sq.0" (Group.adamw_state of one
    tensor). ZeRO-2 makes its state on first use, and only for Muon matrices a rank owns: before its
    first step, or owning only padding, a rank saves nothing of a group."""

    SLICE_KEYS = {"momentum": "momentum", "exp_avg": "exp_avg.0", "exp_avg_sq": "exp_avg_sq.0"}

    @staticmethod
    def whole_of_shards(name: str, layout: dict, shards: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        shape = (layout["shard"], *layout["item"])
        whole = {}
        for key in WHOLE_KEYS[layout["kind"]]:
            saved_key = SlicedState.SLICE_KEYS[key]
            parts = [checked_part(name, saved_key, shard.get(saved_key), shape, f"rank {r}'s")
                     for r, shard in enumerate(shards)]
            dtype = next((p.dtype for p in parts if p is not None), torch.float32)
            slices = [torch.zeros(shape, dtype=dtype) if p is None else p.to(dtype) for p in parts]
            whole[key] = torch.cat(slices)[: layout["items"]].clone()  # the padding dropped
        return whole

    def shard_of_whole(self, g: Group, whole: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        layout = FlatLayout.of(g, self.opt.world_size)
        lo = self.opt.rank * layout.shard
        shard = {}
        for key, tensor in whole.items():
            part = torch.zeros((layout.shard, *layout.item), dtype=tensor.dtype)
            real = tensor[lo: lo + layout.shard]  # fewer items in the last slices, none past the end
            part[: len(real)] = real
            shard[self.SLICE_KEYS[key]] = part
        if g.kind == "adamw":
            shard["exp_avg"] = torch.zeros(0)  # Group.adamw_state's marker: state initialised
        return shard


def view_into(g: Group, layout: FlatLayout, param_buf: torch.Tensor, grad_buf: torch.Tensor,
              copy_values: bool) -> list[torch.Tensor]:
    """Make each parameter's data its place in `param_buf` (the module then reads and trains the
    buffer itself), its values copied in where `copy_values`; return each one's place in `grad_buf`."""
    flat_p, flat_g, views = param_buf.view(-1), grad_buf.view(-1), []
    for p, offset in zip(g.params, layout.offsets, strict=True):
        n = p.numel()
        data = flat_p[offset: offset + n].view_as(p)
        if copy_values:
            data.copy_(p.data)
        p.data = data
        views.append(flat_g[offset: offset + n].view_as(p))
    return views


def grad_into(p: torch.Tensor, view: torch.Tensor) -> bool:
    """Make p.grad its buffer's `view` again, with p's gradient in it (a trainer may have set it to
    None, which counts as zero, or autograd put a fresh tensor there); True where a dense gradient
    of another tensor was copied in."""
    copied = False
    if p.grad is None:
        view.zero_()
    elif p.grad.is_sparse:  # .grad was None at backward time: the buffer holds stale rows
        view.zero_().add_(p.grad)
    elif p.grad.data_ptr() != view.data_ptr():
        view.copy_(p.grad)
        copied = True
    p.grad = view
    return copied
