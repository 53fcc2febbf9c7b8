"""Muon for the block matrices, AdamW for everything else; one class for 1 and N ranks.

With N ranks the optimizer also does the gradient synchronisation, ZeRO-2 style:

1. reduce: each rank receives every rank's gradient of only the slice it owns (an all-to-all:
   Gloo's own reduce-scatter moves as many bytes as an all-reduce) and sums them,
2. it updates that slice with its own (sharded) optimizer state,
3. all-gather: every rank receives every updated slice, straight into the parameters.

Ownership, per group:
- AdamW groups are laid out in one flat buffer, padded to a multiple of the world size, and
  cut into equal contiguous slices: any world size works (no divisibility of the vocabulary).
- Muon groups hold matrices of one shape, stacked and padded with zero matrices to a
  multiple of the world size; each rank orthogonalises whole matrices (Newton-Schulz needs the
  whole matrix), so the orthogonalisation cost is split across ranks too.

Where the bytes go (the wire is the bottleneck between a workstation and a laptop on WiFi):
- Parameters and gradients of a group live in persistent flat buffers; each parameter's data
  and .grad are views into them. Collectives read and write the buffers in place: no copies
  into and out of temporary buffers, no fresh allocations each step.
- The token and value embedding tables get gradients only in the rows of tokens the rank saw.
  Their "reduce" is sparse: ranks all-gather (row id, gradient row) pairs and each adds up the
  rows in its own slice, which is the same sum as a dense reduce-scatter, for a few hundred KB
  instead of the whole table.
- Dense groups start their reduce-scatter from gradient hooks during the last micro-step's
  backward pass (`sync_in_backward`), as soon as the group's last gradient is complete, so the
  LM head's communication overlaps the backward pass of the blocks below it.

With every rank on one host (`shm.SharedArena`), the parameters, every rank's gradients and the
optimizer state live in shared memory instead, and there is no fixed owner: the step is a queue
of work units (a matrix, or a run of rows or elements) that any rank takes as soon as the unit's
gradients are complete on every rank (`_step_shared`). Ranks of one machine never finish their
backward together (on a shared VM one rank's pass of the same work took 729-1,269 ms), so the one
that finishes first works on the LM head and the last layers, whose gradients are final, while
the other is still in its backward; one barrier ends the step. What crosses between processes:
- dense groups: the backward writes each weight gradient straight into the rank's shared buffer
  (grad_target.py; a compiled or autocast model's block gradients, and the scalars', are copied
  in), and whoever takes a unit sums its part of every rank's buffer;
- embedding tables: ranks flag the rows they touched, and a unit adds up only those rows.
The checkpoint keeps per-rank shards: each rank saves its static slice of the shared state.

Collectives are completed with `Work.wait()`, never `Work.get_future()`, which Gloo does not
implement for reduce-scatter.

Gradients are *summed* across ranks: the trainer scales each rank's loss by its share of the
global batch's tokens, so uneven per-rank batches still give the global mean gradient.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from .grad_target import clear_gradients, set_grad_target
from .perf import sync
from .shm import SharedArena

# Quintic Newton-Schulz coefficients (Keller Jordan, modded-nanogpt): maximise the slope at
# zero so 5 iterations push all singular values into roughly [0.7, 1.2].
NS_COEFFS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5

# torch 2.13 renamed the tensor collectives (the old names warn); older torch has only the old ones
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def orthogonalize(g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Approximate U V^T of a stack of matrices (k, m, n) by Newton-Schulz iteration.

    The polynomial's scalings ride in baddbmm's alpha/beta, so each iteration is three GEMMs
    and no separate elementwise passes (which on CPU cost as much as the GEMMs at these sizes).
    """
    a, b, c = NS_COEFFS
    x = g.to(dtype)
    transposed = x.size(-2) > x.size(-1)
    if transposed:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(NS_STEPS):
        gram = torch.bmm(x, x.mT)
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)  # b*G + c*G@G
        x = torch.baddbmm(x, poly, x, beta=a, alpha=1.0)  # a*X + P@X
    if transposed:
        x = x.mT
    return x.to(g.dtype)


@dataclass
class Group:
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
    # sharding bookkeeping, filled in by the optimizer. An item is one element (dense AdamW), one
    # table row (sparse AdamW) or one matrix (Muon); each rank owns `shard` items (in shared
    # memory: checkpoints `shard` items of the state; the work goes to whoever takes it first).
    numel: int = 0
    shard: int = 0
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    # N ranks: persistent buffers of shape (shard x world, *item); parameters and grads are views
    # (in shared memory a dense group's .grad is the view only where the backward wrote it there
    # itself, grad_target.py; otherwise it is autograd's own tensor, copied over by _grad_final_hook
    # or _publish_rest)
    param_buf: torch.Tensor | None = None
    grad_buf: torch.Tensor | None = None
    grad_all: torch.Tensor | None = None  # shared memory: every rank's grad_buf, (world, ...)
    grad_views: list[torch.Tensor] = field(default_factory=list)  # each parameter's place in grad_buf
    offsets: list[int] = field(default_factory=list)  # each parameter's first element in the buffers
    # the summed gradient of the owned items; shared memory: of one work unit of a table
    grad_slice: torch.Tensor | None = None
    master: torch.Tensor | None = None  # the owned items' values, updated, then all-gathered
    update_buf: torch.Tensor | None = None  # every rank's rounded update (--param-comm-dtype bfloat16)
    recv_buf: torch.Tensor | None = None  # every rank's gradient of the owned slice, before the sum
    ready: int = 0  # parameters whose last-micro-step gradient is complete
    # sparse_rows groups: per parameter, the row ids its gradient received since the last
    # zero_grad (None: a dense gradient arrived, every row may be dirty)
    touched: list[list[torch.Tensor] | None] = field(default_factory=list)
    # shared memory: the whole optimizer state, every rank's (state holds this rank's static slice
    # of it, which is what it checkpoints)
    shared_state: dict[str, torch.Tensor] = field(default_factory=dict)
    # shared memory, sparse_rows groups: which rows each rank's gradient has, (world, rows) flags,
    # and the rows of grad_slice the last unit wrote (None: all of them)
    row_marks: torch.Tensor | None = None
    slice_rows: torch.Tensor | None = None
    pending: list = field(default_factory=list)  # in-flight collectives of this step


@dataclass
class WorkUnit:
    """A piece of the shared-memory step that whichever rank gets to it first does: one matrix of
    a Muon group, or a run of rows (tables) or elements of an AdamW group, [lo, hi) in the group's
    items. `gate`: the parameters (indices into MuonAdamW.params) whose gradients it sums."""
    group: Group
    lo: int
    hi: int
    gate: list[int]


# AdamW work units hold about this many elements: ~1 MiB of each tensor, a fraction of a
# millisecond, so the last units leave the ranks' finishing times that close
UNIT_ELEMENTS = 1 << 18
POLL_SECONDS = 2e-4  # a rank with nothing ready to do looks again this often
PEER_CHECK_POLLS = 500  # and every 0.1 s or so checks that the ranks it waits for still run


class MuonAdamW:
    def __init__(self, groups: list[Group], rank: int = 0, world_size: int = 1,
                 muon_dtype: torch.dtype = torch.float32, comm_dtype: torch.dtype = torch.float32,
                 param_comm_dtype: torch.dtype = torch.float32, arena: SharedArena | None = None):
        self.groups = groups
        self.device = groups[0].params[0].device
        self.rank, self.world_size = rank, world_size
        self.muon_dtype = muon_dtype
        # Gradients may travel in bf16 (half the bytes on a slow link).
        self.comm_dtype = comm_dtype
        # Parameters travel in fp32, or as bf16-rounded updates that every rank (the owner too)
        # adds to its fp32 weights: half the bytes, and the weights stay bit-identical.
        self.param_comm_dtype = param_comm_dtype
        # Ranks on one host: buffers in shared memory, nothing on the wire (no dtype to choose)
        self.arena = arena
        self.step_count = 0
        self.last_comm_wait = 0.0  # seconds the last step spent blocked on communication
        # Set by the trainer around the last micro-step's backward: dense groups then start their
        # reduce-scatter from gradient hooks, or (shared memory) other ranks may update a parameter
        # as soon as its gradient is complete. So its gradients must be final when accumulated and
        # left as they are until step() (no clipping in between). Left False, step() starts everything.
        self.sync_in_backward = False
        self.params = [p for g in groups for p in g.params]
        self.param_index = {id(p): i for i, p in enumerate(self.params)}
        self.last_units_run = 0  # shared memory: how many work units this rank did in the last step
        for g in groups:
            if g.kind == "muon":
                shapes = {tuple(p.shape) for p in g.params}
                assert len(shapes) == 1, f"muon group {g.name} mixes shapes {shapes}"
                g.numel = len(g.params)  # number of matrices
            elif g.sparse_rows:
                widths = {tuple(p.shape[1:]) for p in g.params}
                assert all(p.dim() == 2 for p in g.params) and len(widths) == 1, f"{g.name}: tables differ {widths}"
                g.numel = sum(p.shape[0] for p in g.params)  # rows
            else:
                g.numel = sum(p.numel() for p in g.params)
            g.shard = -(-g.numel // world_size)  # ceil: slices of equal size, last one padded
            for p in g.params:  # an earlier optimizer's shared buffer, if any, is not this one's
                set_grad_target(p, None)
            if world_size > 1:
                self._make_buffers(g)
            if g.sparse_rows:
                self._track_rows(g)
        if self.arena is not None:
            self._make_work_queue()
            dist.barrier()  # every rank points at the shared copy before anyone trains on it

    # ---- buffers: parameters and gradients as views of one flat tensor per group ------------

    def _item_shape(self, g: Group) -> tuple[int, ...]:
        p0 = g.params[0]
        return tuple(p0.shape) if g.kind == "muon" else tuple(p0.shape[1:]) if g.sparse_rows else ()

    def _item_numel(self, g: Group) -> int:
        return math.prod(self._item_shape(g))

    def _make_buffers(self, g: Group) -> None:
        p0, item = g.params[0], self._item_shape(g)
        shape = (g.shard * self.world_size, *item)
        if self.arena is not None:
            g.param_buf = self.arena.tensor(f"{g.name}.param", shape, p0.dtype)
            g.grad_all = self.arena.tensor(f"{g.name}.grad", (self.world_size, *shape), p0.dtype)
            g.grad_buf = g.grad_all[self.rank]
        else:
            g.param_buf = torch.zeros(shape, dtype=p0.dtype, device=p0.device)
            g.grad_buf = torch.zeros(shape, dtype=p0.dtype, device=p0.device)
        flat_p, flat_g, offset = g.param_buf.view(-1), g.grad_buf.view(-1), 0
        for p in g.params:
            n = p.numel()
            data, grad = flat_p[offset: offset + n].view_as(p), flat_g[offset: offset + n].view_as(p)
            if self.arena is None or self.rank == 0:  # shared: one copy (the ranks' weights are equal)
                data.copy_(p.data)
            p.data = data  # the module now reads and trains the buffer itself
            if self.arena is None or g.sparse_rows:
                p.grad = grad
            else:  # shared dense groups: the backward's own GEMMs write into the buffer (grad_target.py)
                set_grad_target(p, grad)
            g.grad_views.append(grad)
            g.offsets.append(offset)
            offset += n
            if g.sparse_rows:
                continue
            if self.arena is None:
                p.register_post_accumulate_grad_hook(self._grad_ready_hook(g))
            else:
                p.register_post_accumulate_grad_hook(self._grad_final_hook(grad))
        if self.arena is not None:  # the shared buffers are all a step needs (_step_shared)
            self._make_shared_state(g, shape)
            if g.sparse_rows:  # and one work unit's rows to add up the touched ones in
                g.row_marks = self.arena.tensor(f"{g.name}.rows", (self.world_size, shape[0]), torch.bool)
                g.grad_slice = torch.zeros((self._unit_items(g), *item), dtype=p0.dtype, device=p0.device)
            return
        g.grad_slice = torch.zeros((g.shard, *item), dtype=p0.dtype, device=p0.device)
        g.master = torch.zeros_like(g.grad_slice)
        if self.param_comm_dtype != p0.dtype:
            g.update_buf = torch.zeros(shape, dtype=self.param_comm_dtype, device=p0.device)

    def _unit_items(self, g: Group) -> int:
        """How many items (rows, elements) an AdamW work unit holds."""
        return max(1, UNIT_ELEMENTS // self._item_numel(g))

    def _make_shared_state(self, g: Group, shape: tuple[int, ...]) -> None:
        """The optimizer state in shared memory, since any rank may update any unit; `state` keeps
        this rank's static slice of it, under the names and shapes the Gloo path checkpoints."""
        names = ["momentum"] if g.kind == "muon" else ["exp_avg", "exp_avg_sq"]
        g.shared_state = {n: self.arena.tensor(f"{g.name}.{n}", shape, g.params[0].dtype) for n in names}
        mine = {n: t[self.rank * g.shard: (self.rank + 1) * g.shard] for n, t in g.shared_state.items()}
        if g.kind == "muon":
            g.state["momentum"] = mine["momentum"]
        else:
            self._adamw_state(g, [mine["exp_avg"]], [(mine["exp_avg"], mine["exp_avg_sq"])])

    def _make_work_queue(self) -> None:
        """The step's work units, largest first (a rank takes the first one that is ready, so the
        small ones are left to even out the end), and the shared tables that hand them out:
        ready_at[rank, parameter] and claimed[unit] hold the step number they were last set in."""
        units = []
        for g in self.groups:
            if g.kind == "muon":
                units += [WorkUnit(g, i, i + 1, [self.param_index[id(g.params[i])]]) for i in range(g.numel)]
                continue
            per_item, size = self._item_numel(g), self._unit_items(g)
            for lo in range(0, g.numel, size):
                hi = min(lo + size, g.numel)
                gate = [self.param_index[id(p)] for p, start in zip(g.params, g.offsets, strict=True)
                        if start < hi * per_item and lo * per_item < start + p.numel()]
                units.append(WorkUnit(g, lo, hi, gate))
        # the orthogonalisations first: they are the big ones
        units.sort(key=lambda u: (u.group.kind != "muon", -(u.hi - u.lo) * self._item_numel(u.group)))
        self.units = units
        self.gates = np.zeros((len(units), len(self.params)), dtype=bool)
        for i, u in enumerate(units):
            self.gates[i, u.gate] = True
        self.ready_at = self.arena.tensor("ready", (self.world_size, len(self.params)), torch.int64).numpy()
        self.claimed = self.arena.tensor("claimed", (len(units),), torch.int64).numpy()
        self.lock = self.arena.lock("queue")
        self.pids = self.arena.tensor("pids", (self.world_size,), torch.int64).numpy()
        self.pids[self.rank] = os.getpid()
        largest = max((u.hi - u.lo) * self._item_numel(u.group) for u in units if not u.group.sparse_rows)
        self.scratch = torch.zeros(largest, dtype=self.params[0].dtype, device=self.device)

    def _grad_final_hook(self, view: torch.Tensor):
        """Shared memory: once the last micro-step's gradient of a parameter is complete, put it
        in its place in the shared buffer (if the backward did not write it there itself) and tell
        the other ranks, which may then work on it while this rank's backward goes on."""
        def hook(p: torch.Tensor) -> None:
            if not self.sync_in_backward:
                return
            i, stamp = self.param_index[id(p)], self.step_count + 1
            if self.ready_at[self.rank, i] == stamp:  # other ranks may be updating the weight already
                raise RuntimeError(
                    f"a parameter {tuple(p.shape)} got a second gradient in the last micro-step's backward "
                    f"(a reentrant checkpoint, or a second backward): with ranks sharing memory a gradient "
                    f"must be final when it is first accumulated. Fix: --local-comm gloo")
            self._publish_grad(p, view)
            with self.lock:
                self.ready_at[self.rank, i] = stamp
        return hook

    def _track_rows(self, g: Group) -> None:
        """Embedding tables keep one dense gradient that the backward adds its rows into (the
        model asks for sparse gradients), and zero_grad clears only the rows that got some:
        nothing of the size of the table is zeroed, allocated or added up per step."""
        if not g.grad_views:  # one rank: no shared buffer, a private gradient per table
            g.grad_views = [torch.zeros_like(p) for p in g.params]
            for p, grad in zip(g.params, g.grad_views, strict=True):
                p.grad = grad
        g.touched = [[] for _ in g.params]
        for i, p in enumerate(g.params):
            p.register_hook(self._row_hook(g, i))

    @staticmethod
    def _row_hook(g: Group, i: int):
        def hook(grad: torch.Tensor) -> None:
            if not grad.is_sparse:  # a compiled model's embedding backward is dense
                g.touched[i] = None
            elif g.touched[i] is not None:
                g.touched[i].append(grad._indices()[0])
        return hook

    @staticmethod
    def _dirty_rows(g: Group) -> torch.Tensor | None:
        """The rows (of the group's stacked tables) whose gradient may be non-zero; None: any."""
        ids, offset = [], 0
        for p, rows in zip(g.params, g.touched, strict=True):
            if rows is None:
                return None
            ids += [r + offset for r in rows]
            offset += p.shape[0]
        return torch.cat(ids).unique() if ids else torch.zeros(0, dtype=torch.int64, device=g.params[0].device)

    def _grad_ready_hook(self, g: Group):
        def hook(_param: torch.Tensor) -> None:
            if not self.sync_in_backward or g.pending:
                return
            g.ready += 1
            if g.ready == len(g.params):
                self._start_reduce(g)
        return hook

    def _grads_into_buffer(self, g: Group) -> None:
        """Make every .grad the buffer's view again (a trainer may have set grads to None).
        Not for shared-memory dense groups, which have gradient targets instead (_grad_final_hook)."""
        for i, (p, grad) in enumerate(zip(g.params, g.grad_views, strict=True)):
            if p.grad is None:
                grad.zero_()
            elif p.grad.is_sparse:  # .grad was None at backward time: the buffer holds stale rows
                grad.zero_().add_(p.grad)
            elif p.grad.data_ptr() != grad.data_ptr():
                grad.copy_(p.grad)
                if g.sparse_rows:  # a dense gradient: any row may be non-zero
                    g.touched[i] = None
            p.grad = grad

    # ---- communication -----------------------------------------------------------------------

    def _start_reduce(self, g: Group) -> None:
        """Start summing the group's gradients across ranks; each rank gets its own slice."""
        self._grads_into_buffer(g)
        if g.sparse_rows:
            self._start_sparse_reduce(g)
            return
        send = g.grad_buf if self.comm_dtype == g.grad_buf.dtype else g.grad_buf.to(self.comm_dtype)
        if g.recv_buf is None:
            g.recv_buf = torch.empty_like(send)
        # each rank receives every rank's copy of its own slice and adds them up (_finish_reduce):
        # the bytes of an optimal reduce-scatter. Gloo's reduce_scatter costs an all-reduce
        # (measured on 3 nodes at 100 Mbit/s: 1.95 s for 16 MiB, all-reduce 1.92 s, this 1.54 s)
        g.pending = [("dense", g.recv_buf, dist.all_to_all_single(g.recv_buf, send, async_op=True))]

    def _start_sparse_reduce(self, g: Group) -> None:
        """All-gather (row id, gradient row) for the rows this rank touched; padded to the
        largest count, which costs one tiny synchronous exchange first."""
        ids = self._dirty_rows(g)
        if ids is None:
            ids = g.grad_buf.any(dim=1).nonzero().squeeze(1)
        count = torch.tensor([ids.numel()], dtype=torch.int64, device=ids.device)
        counts = torch.empty(self.world_size, dtype=torch.int64, device=ids.device)
        self._wait(all_gather(counts, count, async_op=True))
        width = int(counts.max())
        send_ids = torch.full((width,), -1, dtype=torch.int64, device=ids.device)
        send_ids[: ids.numel()] = ids
        send_rows = torch.zeros((width, g.grad_buf.shape[1]), dtype=self.comm_dtype, device=ids.device)
        send_rows[: ids.numel()] = g.grad_buf[ids]
        all_ids = torch.empty(width * self.world_size, dtype=torch.int64, device=ids.device)
        all_rows = torch.empty((width * self.world_size, g.grad_buf.shape[1]), dtype=self.comm_dtype,
                               device=ids.device)
        g.pending = [("ids", all_ids, all_gather(all_ids, send_ids, async_op=True)),
                     ("rows", all_rows, all_gather(all_rows, send_rows, async_op=True))]

    def _wait(self, work: dist.Work) -> None:
        """Block until a collective is complete; the time counts as communication wait. On CUDA,
        Work.wait() only makes the compute stream wait, so the host synchronises too: otherwise
        the wait would surface, unmeasured, in whatever synchronises next."""
        sync(self.device)  # the update kernels queued before it are optimizer time, not waiting
        t0 = time.perf_counter()
        work.wait()
        sync(self.device)
        self.last_comm_wait += time.perf_counter() - t0

    def _finish_reduce(self, g: Group) -> None:
        got = {}
        for kind, tensor, work in g.pending:
            self._wait(work)
            got[kind] = tensor
        g.pending = []
        if "dense" in got:  # (world, shard, *item): every rank's gradient of this rank's slice
            torch.sum(got["dense"].view(self.world_size, *g.grad_slice.shape), dim=0, dtype=g.grad_slice.dtype,
                      out=g.grad_slice)
            return
        # rows from every rank, in rank order: add up those in this rank's slice
        lo = self.rank * g.shard
        ids, rows = got["ids"], got["rows"]
        mine = (ids >= lo) & (ids < lo + g.shard)
        g.grad_slice.zero_()
        g.grad_slice.index_add_(0, ids[mine] - lo, rows[mine].to(g.grad_slice.dtype))

    # ---- updates: the owned slice (Gloo), a work unit (shared memory), everything (1 rank) ----

    @staticmethod
    def _adamw_state(g: Group, params: list[torch.Tensor],
                     keep_in: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                     ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The moments of a list of tensors (the owned slice with N ranks, the parameters with 1),
        made on first use as zeros, or `keep_in` the given (first, second moment) tensors."""
        if "exp_avg" not in g.state:
            for i, p in enumerate(params):
                m, v = keep_in[i] if keep_in else (torch.zeros_like(p), torch.zeros_like(p))
                g.state[f"exp_avg.{i}"], g.state[f"exp_avg_sq.{i}"] = m, v
            g.state["exp_avg"] = torch.zeros(0)  # marker: state initialised
        return ([g.state[f"exp_avg.{i}"] for i in range(len(params))],
                [g.state[f"exp_avg_sq.{i}"] for i in range(len(params))])

    def _adamw(self, g: Group, params: list[torch.Tensor], grads: list[torch.Tensor],
               m: list[torch.Tensor], v: list[torch.Tensor]) -> None:
        b1, b2 = g.betas
        lr = g.lr * g.lr_multiplier
        # one fused, vectorised pass over memory (the embeddings dominate the optimizer's bytes)
        # the step counts live with the parameters: the CUDA kernel reads them on the device
        steps = [torch.tensor(float(self.step_count), dtype=torch.float32, device=p.device) for p in params]
        torch._fused_adamw_(params, grads, m, v, [], steps, lr=lr, beta1=b1, beta2=b2,
                            weight_decay=g.weight_decay, eps=g.eps, amsgrad=False, maximize=False)

    def _muon(self, g: Group, params: torch.Tensor | list[torch.Tensor], grads: torch.Tensor,
              mom: torch.Tensor) -> None:
        """Momentum, orthogonalisation and update of stacked matrices (`grads` is overwritten).

        `params` is a stacked slice (N ranks) or the list of parameters (1 rank).
        """
        mom.lerp_(grads, 1 - g.momentum)
        update = orthogonalize(grads.lerp_(mom, g.momentum), self.muon_dtype)  # Nesterov
        rows, cols = grads.shape[-2:]
        lr = g.lr * g.lr_multiplier * max(1.0, rows / cols) ** 0.5
        # one stacked update (N ranks) or one per parameter (1 rank)
        pairs = [(params, update)] if isinstance(params, torch.Tensor) else zip(params, update, strict=True)
        for p, u in pairs:
            if g.weight_decay:
                p.mul_(1 - lr * g.weight_decay)
            p.add_(u, alpha=-lr)

    def _owned_items(self, g: Group) -> int:
        return max(0, min(g.shard, g.numel - self.rank * g.shard))

    # ---- the step ----------------------------------------------------------------------------

    @property
    def step_phase(self) -> str:
        """What step() waits on, for the watchdog's message when it hangs or fails."""
        if self.world_size == 1:
            return "optimizer step"
        if self.arena is not None:
            return "optimizer step (shared-memory work queue)"
        return "optimizer reduce-scatter/all-gather"

    @torch.no_grad()
    def step(self) -> None:
        self.step_count += 1
        self.sync_in_backward = False
        self.last_comm_wait = 0.0
        if self.world_size == 1:
            for g in self.groups:
                if g.sparse_rows:
                    self._grads_into_buffer(g)
                params = [p.data for p in g.params]
                if g.kind == "adamw":
                    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in g.params]
                    self._adamw(g, params, grads, *self._adamw_state(g, params))
                    continue
                grads = torch.stack([p.grad if p.grad is not None else torch.zeros_like(p) for p in g.params])
                mom = g.state.setdefault("momentum", torch.zeros_like(grads))
                self._muon(g, params, grads, mom)
            return
        if self.arena is not None:
            self._step_shared()
            return
        # dense groups whose hooks did not fire (no sync_in_backward), then the sparse tables
        # (their gradients complete last: the embeddings are the first layer)
        for g in sorted(self.groups, key=lambda g: g.sparse_rows):
            if not g.pending:
                self._start_reduce(g)
        gathers = []
        for g in self.groups:
            self._finish_reduce(g)
            lo = self.rank * g.shard
            owned = g.param_buf[lo: lo + g.shard]
            g.master.copy_(owned)
            if g.kind == "muon":
                n = self._owned_items(g)  # matrices past the last are padding: left alone
                if n > 0:
                    mom = g.state.setdefault("momentum", torch.zeros_like(g.grad_slice))
                    self._muon(g, g.master[:n], g.grad_slice[:n], mom[:n])
            else:  # padding past the last parameter has zero gradient, so Adam keeps it at zero
                self._adamw(g, [g.master], [g.grad_slice], *self._adamw_state(g, [g.master]))
            if g.update_buf is None:
                gathers.append((g, all_gather(g.param_buf, g.master, async_op=True)))
            else:
                update = g.master.sub_(owned).to(self.param_comm_dtype)
                gathers.append((g, all_gather(g.update_buf, update, async_op=True)))
        for g, work in gathers:
            self._wait(work)
            if g.update_buf is not None:  # the same rounded update on every rank, owner included
                g.param_buf.add_(g.update_buf)

    def _barrier(self) -> None:
        t0 = time.perf_counter()
        dist.barrier()
        self.last_comm_wait += time.perf_counter() - t0

    def _step_shared(self) -> None:
        """The N-rank step on one host. The parameters, every rank's gradients and the optimizer
        state live in shared memory, so any rank can update any part: the step is a queue of work
        units (one matrix, or a run of rows or elements) that the ranks take from as the units'
        gradients become complete on every rank. A rank whose backward finished early starts on the
        LM head and the last layers while a slower one is still in its backward (their gradients
        are final: _grad_final_hook), instead of waiting for it at a barrier."""
        stamp, polls = self.step_count, 0
        self.last_units_run = 0
        self._publish_rest(stamp)
        while True:
            index = self._claim(stamp)
            if index is None:
                break
            if index < 0:  # every unit left waits for a gradient still being computed
                t0 = time.perf_counter()
                time.sleep(POLL_SECONDS)
                self.last_comm_wait += time.perf_counter() - t0
                polls += 1
                if polls % PEER_CHECK_POLLS == 0:
                    self._check_peers_alive()
                continue
            self._run_unit(self.units[index])
            self.last_units_run += 1
        # every unit done and every gradient read: the parameters may be used, the gradient
        # buffers written again. Until then no rank reads a parameter (the forward) or a moment
        # (a checkpoint) that another may still be updating.
        self._barrier()

    def _publish_rest(self, stamp: int) -> None:
        """Everything the gradient hooks did not make available: the tables' rows (flagged for the
        units that sum them), dense gradients of a step without sync_in_backward, and parameters
        without a gradient (zero). Then every parameter of this rank is ready."""
        mine = self.ready_at[self.rank]
        for g in self.groups:
            if g.sparse_rows:  # the backward added the rows in already: tell the units which
                self._grads_into_buffer(g)
                ids, marks = self._dirty_rows(g), g.row_marks[self.rank]
                if ids is None:
                    marks.fill_(True)
                else:
                    marks.index_fill_(0, ids, True)
                continue
            for p, view in zip(g.params, g.grad_views, strict=True):
                if mine[self.param_index[id(p)]] != stamp:
                    self._publish_grad(p, view)
        with self.lock:
            mine[:] = stamp

    def _check_peers_alive(self) -> None:
        """Through Gloo a dead peer breaks the connection; waiting on shared memory it would not:
        a rank gone (or a zombie, not yet reaped by its launcher) stops this one with its name."""
        for rank, pid in enumerate(self.pids):
            if rank == self.rank:
                continue
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                state = "gone"
            if state in ("gone", "Z", "X"):
                raise RuntimeError(f"rank {rank} (pid {pid}) of this host exited in the middle of step "
                                   f"{self.step_count}: this rank waits for its gradients in shared memory")

    def _claim(self, stamp: int) -> int | None:
        """Take the first unit nobody has taken whose gradients are complete on every rank; -1 if
        the units left all wait for some, None if none is left."""
        with self.lock:
            free = self.claimed != stamp
            if not free.any():
                return None
            ready = (self.ready_at == stamp).all(axis=0)
            can = free & ~(self.gates & ~ready).any(axis=1)
            if not can.any():
                return -1
            index = int(can.argmax())
            self.claimed[index] = stamp
            return index

    def _run_unit(self, u: WorkUnit) -> None:
        g = u.group
        grad = self._sum_table_rows(u) if g.sparse_rows else self._sum_dense(u)
        params = g.param_buf[u.lo: u.hi]
        if g.kind == "muon":
            self._muon(g, params, grad, g.shared_state["momentum"][u.lo: u.hi])
        else:
            self._adamw(g, [params], [grad], [g.shared_state["exp_avg"][u.lo: u.hi]],
                        [g.shared_state["exp_avg_sq"][u.lo: u.hi]])

    @staticmethod
    def _publish_grad(p: torch.Tensor, view: torch.Tensor) -> None:
        """Put p's gradient at its place in the shared buffer, unless the backward wrote it there
        itself (grad_target.py); no gradient counts as zero."""
        if p.grad is None:
            view.zero_()
        elif p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)

    def _sum_dense(self, u: WorkUnit) -> torch.Tensor:
        """The unit's gradient summed over ranks, in rank order whoever sums it (the same bits on
        any rank), into this rank's private scratch: the shared buffers are only read."""
        item, n = self._item_shape(u.group), self._item_numel(u.group)
        a, b = u.lo * n, u.hi * n
        parts = [grads.view(-1)[a:b] for grads in u.group.grad_all]
        out = self.scratch[: b - a]
        torch.add(parts[0], parts[1], out=out)
        for part in parts[2:]:
            out.add_(part)
        return out.view(u.hi - u.lo, *item)

    def _sum_table_rows(self, u: WorkUnit) -> torch.Tensor:
        """The unit's rows of a table's summed gradient, from only the rows some rank touched (a
        few hundred of the table's tens of thousands); the other rows of grad_slice stay zero."""
        g = u.group
        ids = g.row_marks[:, u.lo: u.hi].any(dim=0).nonzero().squeeze(1)
        grad, rows = g.grad_slice[: u.hi - u.lo], g.grad_all[:, u.lo: u.hi]
        if ids.numel() > (u.hi - u.lo) // 4:  # many rows (a dense gradient flags all): whole runs are cheaper
            torch.sum(rows, dim=0, out=grad)
            g.slice_rows = None
            return grad
        if g.slice_rows is None:
            g.grad_slice.zero_()
        else:
            g.grad_slice.index_fill_(0, g.slice_rows, 0)  # the rows the last unit wrote
        summed = rows[0].index_select(0, ids)
        for r in range(1, self.world_size):
            summed.add_(rows[r].index_select(0, ids))
        grad.index_copy_(0, ids, summed)
        g.slice_rows = ids
        return grad

    def zero_grad(self) -> None:
        """Call after every step (model.zero_grad() is not enough): it clears the tables' touched
        rows and this rank's row flags, which would otherwise pile up step after step."""
        for g in self.groups:
            g.ready = 0
            if g.sparse_rows:
                self._clear_rows(g)
                if g.row_marks is not None:  # every unit has read them (the step's barrier)
                    g.row_marks[self.rank].zero_()
                continue
            if g.grad_buf is None or self.arena is not None:  # shared memory: written afresh into the buffer
                clear_gradients(g.params)
                continue
            g.grad_buf.zero_()
            for p, grad in zip(g.params, g.grad_views, strict=True):
                p.grad = grad

    @staticmethod
    def _clear_rows(g: Group) -> None:
        """Zero the rows the buffer got since the last zero_grad. `touched` lists them even across
        a trainer's .grad = None (the buffer keeps the rows, the list keeps their ids); it is None
        once a dense gradient reached the buffer (_row_hook, _grads_into_buffer)."""
        for i, (p, grad) in enumerate(zip(g.params, g.grad_views, strict=True)):
            if g.touched[i] is None:
                grad.zero_()
            else:
                for rows in g.touched[i]:
                    grad.index_fill_(0, rows, 0)
            p.grad = grad
            g.touched[i] = []

    # ---- checkpointing: each rank saves and loads only its own shard -----------------------

    def state_dict(self) -> dict:
        return {
            "step_count": self.step_count,
            "world_size": self.world_size,
            "rank": self.rank,
            "groups": {g.name: {k: v.clone() for k, v in g.state.items()} for g in self.groups},
        }

    def load_state_dict(self, sd: dict) -> None:
        if sd["world_size"] != self.world_size or sd["rank"] != self.rank:
            raise ValueError(
                f"optimizer shard was saved by rank {sd['rank']} of {sd['world_size']}, this is rank "
                f"{self.rank} of {self.world_size}: keep the same hosts and processes per node to resume, "
                f"or start a new run (--resume never)")
        self.step_count = sd["step_count"]
        for g in self.groups:  # checkpoints are read onto the CPU: the state goes to the parameters' device
            saved = sd["groups"][g.name]
            if self.arena is None:
                g.state = {k: v.to(self.device, copy=True) for k, v in saved.items()}
                continue
            # a Gloo rank that owns no matrix of a group saves no state for it: zeros, as here
            mismatch = [k for k in saved.keys() | g.state.keys() if saved and (
                k not in saved or k not in g.state or saved[k].shape != g.state[k].shape)]
            if mismatch:
                raise ValueError(f"optimizer shard of group {g.name} does not fit this optimizer ({sorted(mismatch)}): "
                                 f"not a checkpoint of this run's optimizer; start a new run (--resume never)")
            # into this rank's slice of the shared state. No other rank reads it before this rank's
            # gradients of the next step are ready (_claim), which is after this returns.
            for k, v in saved.items():
                g.state[k].copy_(v)


def build_optimizer(model, cfg, rank: int, world_size: int, muon_dtype: torch.dtype,
                    arena: SharedArena | None = None) -> MuonAdamW:
    from .model import parameter_groups

    groups = parameter_groups(model)
    # AdamW LRs were tuned at width 768; scale them like 1/sqrt(width) (nanochat's rule)
    scale = (model.cfg.n_embd / 768) ** -0.5
    adamw = [
        Group("adamw", "lm_head", groups["lm_head"], lr=cfg.unembedding_lr * scale),
        Group("adamw", "embedding", groups["embedding"], lr=cfg.embedding_lr * scale, sparse_rows=True),
        Group("adamw", "value_embedding", groups["value_embedding"], lr=cfg.embedding_lr * scale,
              sparse_rows=True),
        Group("adamw", "scalar", groups["scalar"], lr=cfg.scalar_lr * 0.01),
    ]
    by_shape: dict[tuple[int, ...], list[torch.nn.Parameter]] = {}
    for p in groups["matrix"]:
        by_shape.setdefault(tuple(p.shape), []).append(p)
    muon = [Group("muon", f"matrix_{'x'.join(map(str, shape))}", ps, lr=cfg.matrix_lr,
                  weight_decay=cfg.weight_decay) for shape, ps in sorted(by_shape.items())]
    wire = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    return MuonAdamW([g for g in adamw if g.params] + muon, rank, world_size, muon_dtype,
                     wire[cfg.grad_comm_dtype], wire[cfg.param_comm_dtype], arena)
