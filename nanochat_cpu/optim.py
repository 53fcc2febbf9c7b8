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

With every rank on one host (`shm.SharedArena`), the parameters and every rank's gradients live in
shared memory instead: each rank sums its slice from the others' gradient buffers and updates its
slice of the one parameter copy in place; two barriers per step replace the collectives. What
crosses between processes is kept to what the owner needs:
- dense groups: the backward writes each weight gradient straight into the rank's shared buffer
  (grad_target.py; a compiled or autocast model's block gradients, and the scalars', are copied
  in), and the owner adds the others' parts into its own part in place;
- embedding tables: ranks flag the rows they touched, and the owner adds up only those rows.

Collectives are completed with `Work.wait()`, never `Work.get_future()`, which Gloo does not
implement for reduce-scatter.

Gradients are *summed* across ranks: the trainer scales each rank's loss by its share of the
global batch's tokens, so uneven per-rank batches still give the global mean gradient.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .grad_target import release_grad_target, set_grad_target
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
    # sharding bookkeeping, filled in by the optimizer. A unit is one element (dense AdamW),
    # one table row (sparse AdamW) or one matrix (Muon); each rank owns `shard` units.
    numel: int = 0
    shard: int = 0
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    # N ranks: persistent buffers of shape (shard x world, *unit); parameters and grads are views
    # (in shared memory a dense group's .grad is the view only where the backward wrote it there
    # itself, grad_target.py; otherwise it is autograd's own tensor, copied over by _publish_dense)
    param_buf: torch.Tensor | None = None
    grad_buf: torch.Tensor | None = None
    grad_all: torch.Tensor | None = None  # shared memory: every rank's grad_buf, (world, ...)
    grad_views: list[torch.Tensor] = field(default_factory=list)  # each parameter's place in grad_buf
    offsets: list[int] = field(default_factory=list)  # each parameter's first element in the buffers
    grad_slice: torch.Tensor | None = None  # the summed gradient of the owned units (not shared dense)
    master: torch.Tensor | None = None  # the owned units' values, updated, then all-gathered
    update_buf: torch.Tensor | None = None  # every rank's rounded update (--param-comm-dtype bfloat16)
    recv_buf: torch.Tensor | None = None  # every rank's gradient of the owned slice, before the sum
    ready: int = 0  # parameters whose last-micro-step gradient is complete
    # sparse_rows groups: per parameter, the row ids its gradient received since the last
    # zero_grad (None: a dense gradient arrived, every row may be dirty)
    touched: list[list[torch.Tensor] | None] = field(default_factory=list)
    # shared memory, sparse_rows groups: which rows each rank's gradient has, (world, rows) flags,
    # and the rows of grad_slice the last step wrote (None: all of them)
    row_marks: torch.Tensor | None = None
    slice_rows: torch.Tensor | None = None
    pending: list = field(default_factory=list)  # in-flight collectives of this step


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
        # Set by the trainer around the last micro-step's backward: dense groups then start
        # their reduce-scatter from gradient hooks. Left False, step() starts everything.
        self.sync_in_backward = False
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
            dist.barrier()  # every rank points at the shared copy before anyone trains on it

    # ---- buffers: parameters and gradients as views of one flat tensor per group ------------

    def _unit(self, g: Group) -> tuple[int, ...]:
        p0 = g.params[0]
        return tuple(p0.shape) if g.kind == "muon" else tuple(p0.shape[1:]) if g.sparse_rows else ()

    def _make_buffers(self, g: Group) -> None:
        p0, unit = g.params[0], self._unit(g)
        shape = (g.shard * self.world_size, *unit)
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
            if not g.sparse_rows and self.arena is None:
                p.register_post_accumulate_grad_hook(self._grad_ready_hook(g))
        if self.arena is not None:  # the shared buffers are all a step needs (_step_shared)
            if g.sparse_rows:  # and a slice to add up the touched rows in
                g.row_marks = self.arena.tensor(f"{g.name}.rows", (self.world_size, shape[0]), torch.bool)
                g.grad_slice = torch.zeros((g.shard, *unit), dtype=p0.dtype, device=p0.device)
            return
        g.grad_slice = torch.zeros((g.shard, *unit), dtype=p0.dtype, device=p0.device)
        g.master = torch.zeros_like(g.grad_slice)
        if self.param_comm_dtype != p0.dtype:
            g.update_buf = torch.zeros(shape, dtype=self.param_comm_dtype, device=p0.device)

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
        Not for shared-memory dense groups, which have gradient targets instead (_publish_dense)."""
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
        if "dense" in got:  # (world, shard, *unit): every rank's gradient of this rank's slice
            torch.sum(got["dense"].view(self.world_size, *g.grad_slice.shape), dim=0, dtype=g.grad_slice.dtype,
                      out=g.grad_slice)
            return
        # rows from every rank, in rank order: add up those in this rank's slice
        lo = self.rank * g.shard
        ids, rows = got["ids"], got["rows"]
        mine = (ids >= lo) & (ids < lo + g.shard)
        g.grad_slice.zero_()
        g.grad_slice.index_add_(0, ids[mine] - lo, rows[mine].to(g.grad_slice.dtype))

    # ---- updates on the owned slice ----------------------------------------------------------

    def _adamw(self, g: Group, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        """AdamW on a list of tensors (the owned slice with N ranks, the parameters with 1)."""
        if "exp_avg" not in g.state:
            for i, p in enumerate(params):
                g.state[f"exp_avg.{i}"] = torch.zeros_like(p)
                g.state[f"exp_avg_sq.{i}"] = torch.zeros_like(p)
            g.state["exp_avg"] = torch.zeros(0)  # marker: state initialised
        m = [g.state[f"exp_avg.{i}"] for i in range(len(params))]
        v = [g.state[f"exp_avg_sq.{i}"] for i in range(len(params))]
        b1, b2 = g.betas
        lr = g.lr * g.lr_multiplier
        # one fused, vectorised pass over memory (the embeddings dominate the optimizer's bytes)
        # the step counts live with the parameters: the CUDA kernel reads them on the device
        steps = [torch.tensor(float(self.step_count), dtype=torch.float32, device=p.device) for p in params]
        torch._fused_adamw_(params, grads, m, v, [], steps, lr=lr, beta1=b1, beta2=b2,
                            weight_decay=g.weight_decay, eps=g.eps, amsgrad=False, maximize=False)

    def _muon(self, g: Group, params: torch.Tensor | list[torch.Tensor], grads: torch.Tensor, owned: int) -> None:
        """Momentum, orthogonalisation and update of the first `owned` stacked matrices.

        `params` is the stacked slice (N ranks) or the list of parameters (1 rank); rows past
        `owned` are padding and are left alone.
        """
        if owned <= 0:
            return
        if "momentum" not in g.state:
            g.state["momentum"] = torch.zeros_like(grads)
        grad, mom = grads[:owned], g.state["momentum"][:owned]
        mom.lerp_(grad, 1 - g.momentum)
        update = orthogonalize(grad.lerp_(mom, g.momentum), self.muon_dtype)  # Nesterov
        rows, cols = grads.shape[-2:]
        lr = g.lr * g.lr_multiplier * max(1.0, rows / cols) ** 0.5
        # one stacked update (N ranks) or one per parameter (1 rank)
        pairs = [(params[:owned], update)] if isinstance(params, torch.Tensor) else zip(params, update, strict=True)
        for p, u in pairs:
            if g.weight_decay:
                p.mul_(1 - lr * g.weight_decay)
            p.add_(u, alpha=-lr)

    def _owned_units(self, g: Group) -> int:
        return max(0, min(g.shard, g.numel - self.rank * g.shard))

    # ---- the step ----------------------------------------------------------------------------

    @torch.no_grad()
    def step(self) -> None:
        self.step_count += 1
        self.sync_in_backward = False
        self.last_comm_wait = 0.0
        if self.world_size == 1:
            for g in self.groups:
                if g.sparse_rows:
                    self._grads_into_buffer(g)
                if g.kind == "adamw":
                    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in g.params]
                    self._adamw(g, [p.data for p in g.params], grads)
                    continue
                grads = torch.stack([p.grad if p.grad is not None else torch.zeros_like(p) for p in g.params])
                self._muon(g, [p.data for p in g.params], grads, len(g.params))
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
                self._muon(g, g.master, g.grad_slice, self._owned_units(g))
            else:  # padding past the last parameter has zero gradient, so Adam keeps it at zero
                self._adamw(g, [g.master], [g.grad_slice])
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
        """The N-rank step on one host: parameters live in shared memory, and each rank's
        shared gradient buffer holds its gradients (the owned part becomes the owner's sum)."""
        for g in self.groups:
            if g.sparse_rows:  # the backward added the rows in already: tell the owners which
                self._grads_into_buffer(g)
                ids, marks = self._dirty_rows(g), g.row_marks[self.rank]
                if ids is None:
                    marks.fill_(True)
                else:
                    marks.index_fill_(0, ids, True)
            else:
                self._publish_dense(g)
        self._barrier()  # every rank's gradients are complete
        for g in self.groups:
            lo = self.rank * g.shard
            grad = self._sum_shared_rows(g, lo) if g.sparse_rows else self._sum_shared_dense(g)
            owned = g.param_buf[lo: lo + g.shard]  # no other rank reads or writes it until the barrier
            if g.kind == "muon":
                self._muon(g, owned, grad, self._owned_units(g))
            else:
                self._adamw(g, [owned], [grad])
        self._barrier()  # every slice updated and every gradient read: the next step may start

    def _owned_elements(self, g: Group) -> tuple[int, int]:
        """[lo, hi) of this rank's slice in the group's flat buffers, in elements."""
        per_unit = math.prod(self._unit(g))
        return self.rank * g.shard * per_unit, (self.rank + 1) * g.shard * per_unit

    @staticmethod
    def _written_in_place(p: torch.Tensor, view: torch.Tensor) -> bool:
        """Whether the backward wrote p's gradient into its place in the shared buffer itself."""
        return p.grad is not None and p.grad.data_ptr() == view.data_ptr()

    def _publish_dense(self, g: Group) -> None:
        """Put the parts of this rank's gradients that other ranks own into its shared buffer.
        Gradients the backward wrote there itself (grad_target.py) are in place already; others
        (a compiled or autocast model's, the scalars') are copied, except the owned part, which
        _sum_shared_dense reads where it is."""
        lo, hi = self._owned_elements(g)
        shared = g.grad_buf.view(-1)
        for p, start, view in zip(g.params, g.offsets, g.grad_views, strict=True):
            if self._written_in_place(p, view):
                continue
            end = start + p.numel()
            for a, b in ((start, min(end, lo)), (max(start, hi), end)):  # before and after the owned part
                if a < b:
                    if p.grad is None:
                        shared[a:b].zero_()
                    else:
                        shared[a:b].copy_(p.grad.reshape(-1)[a - start: b - start])

    def _sum_shared_dense(self, g: Group) -> torch.Tensor:
        """The owned slice's summed gradient, added up in this rank's own part of its shared
        buffer: no other rank reads that part, and the next backward overwrites it. Padding past
        the last parameter is zero in every buffer and stays so."""
        lo, hi = self._owned_elements(g)
        mine = g.grad_buf.view(-1)[lo:hi]
        others = [g.grad_all[r].view(-1)[lo:hi] for r in range(self.world_size) if r != self.rank]
        for p, start, view in zip(g.params, g.offsets, g.grad_views, strict=True):
            a, b = max(start, lo), min(start + p.numel(), hi)
            if a >= b:
                continue
            out, first_other = mine[a - lo: b - lo], others[0][a - lo: b - lo]
            if self._written_in_place(p, view):
                out.add_(first_other)
            elif p.grad is None:
                out.copy_(first_other)
            else:  # a private gradient: one pass reads it and the first other rank's part
                torch.add(p.grad.reshape(-1)[a - start: b - start], first_other, out=out)
        for other in others[1:]:
            mine.add_(other)
        return mine.view(g.shard, *self._unit(g))

    def _sum_shared_rows(self, g: Group, lo: int) -> torch.Tensor:
        """The owned slice of a table's summed gradient, from only the rows some rank touched
        (a few hundred of the table's tens of thousands); the other rows of grad_slice stay zero.
        Out of place: each rank's shared buffer must keep only its own rows (zero_grad clears them)."""
        ids = g.row_marks[:, lo: lo + g.shard].any(dim=0).nonzero().squeeze(1)
        grad, rows = g.grad_slice, g.grad_all[:, lo: lo + g.shard]
        if ids.numel() > g.shard // 4:  # many rows (a dense gradient flags all): whole slices are cheaper
            torch.sum(rows, dim=0, out=grad)
            g.slice_rows = None
            return grad
        if g.slice_rows is None:
            grad.zero_()
        else:
            grad.index_fill_(0, g.slice_rows, 0)  # the rows the last step wrote
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
                if g.row_marks is not None:  # every owner has read them (the step's last barrier)
                    g.row_marks[self.rank].zero_()
                continue
            # Shared memory: .grad None is what makes the next backward write into the shared
            # buffer afresh (grad_target.py); zeroing it and letting autograd add into it would
            # be 4 passes over all of it
            if g.grad_buf is None or self.arena is not None:
                for p in g.params:
                    p.grad = None
                    release_grad_target(p)
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
            g.state = {k: v.to(self.device, copy=True) for k, v in sd["groups"][g.name].items()}


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
