"""N ranks on one host: buffers in shared memory, the step a queue of work units any rank takes.

With every rank on one host (`shm.SharedArena`), the parameters, every rank's gradients and the
optimizer state live in shared memory, and there is no fixed owner: the step is a queue of work
units (a matrix, or a run of rows or elements) that any rank takes as soon as the unit's
gradients are complete on every rank. Ranks of one machine never finish their backward together
(on a shared VM one rank's pass of the same work took 729-1,269 ms), so the one that finishes
first works on the LM head and the last layers, whose gradients are final, while the other is
still in its backward; one barrier ends the step. What crosses between processes:
- dense groups: the backward writes each weight gradient straight into the rank's shared buffer
  (grad_target.py; a compiled or autocast model's block gradients, and the scalars', are copied
  in), and whoever takes a unit sums its part of every rank's buffer, in rank order (the same
  bits whichever rank sums it);
- embedding tables: ranks flag the rows they touched (sparse_rows.py), and a unit adds up only
  those rows.
The checkpoint keeps per-rank shards: each rank saves its static slice of the shared state, in
the names and shapes of the Gloo path's (sync_zero2.py).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from .grad_target import clear_gradients, set_grad_target
from .shm import SharedArena
from .sparse_rows import TouchedRows
from .sync_strategy import FlatLayout, Group, Optimizer, SlicedState, view_into

# AdamW work units hold about this many elements: ~1 MiB of each tensor, a fraction of a
# millisecond, so the last units leave the ranks' finishing times that close
UNIT_ELEMENTS = 1 << 18
POLL_SECONDS = 2e-4  # a rank with nothing ready to do looks again this often
PEER_CHECK_POLLS = 500  # and every 0.1 s or so checks that the ranks it waits for still run


@dataclass
class SharedGroup:
    """One group's tensors in shared memory: the parameters (items, *item), every rank's gradients
    (world, items, *item) and the whole optimizer state, every rank's (the group's `state` holds
    this rank's static slice of it, which is what it checkpoints)."""

    group: Group
    layout: FlatLayout
    param_buf: torch.Tensor
    grad_all: torch.Tensor
    full_state: dict[str, torch.Tensor]
    # sparse_rows groups: the rows this rank touched, which rows each rank's gradient has,
    # (world, rows) flags, and one work unit's rows to add up the touched ones in, private to
    # this rank, with the rows of it the last unit wrote (None: all of them)
    rows: TouchedRows | None = None
    row_marks: torch.Tensor | None = None
    unit_grad: torch.Tensor | None = None
    unit_rows: torch.Tensor | None = None


@dataclass
class WorkUnit:
    """A piece of the step that whichever rank gets to it first does: one matrix of a Muon group,
    or a run of rows (tables) or elements of an AdamW group, [lo, hi) in the group's items.
    `gate`: the parameters (indices into the optimizer's params) whose gradients it sums."""

    shared: SharedGroup
    lo: int
    hi: int
    gate: list[int]

    @property
    def group(self) -> Group:
        return self.shared.group


class SharedMemorySync(SlicedState):
    """Every rank maps the whole state; each checkpoints (and loads) only its static slice of it
    (SlicedState), so the slices of all ranks make the whole, as with ZeRO-2's owners."""

    phase = "optimizer step (shared-memory work queue)"
    name = "shared"

    def __init__(self, opt: Optimizer, arena: SharedArena):
        super().__init__(opt)
        self.arena, self.rank, self.world_size = arena, opt.rank, opt.world_size
        self.param_index = {id(p): i for i, p in enumerate(opt.params)}
        self.last_units_run = 0  # how many work units this rank did in the last step
        self.shared = [self._make_shared(g) for g in opt.groups]
        self._make_work_queue()
        dist.barrier(group=opt.group)  # every rank points at the shared copy before anyone trains on it

    def _make_shared(self, g: Group) -> SharedGroup:
        layout = FlatLayout.of(g, self.world_size)
        shape, dtype = layout.shape, g.params[0].dtype
        param_buf = self.arena.tensor(f"{g.name}.param", shape, dtype)
        grad_all = self.arena.tensor(f"{g.name}.grad", (self.world_size, *shape), dtype)
        # one copy of the weights (the ranks' are equal): rank 0's
        g.grad_views = view_into(g, layout, param_buf, grad_all[self.rank], copy_values=self.rank == 0)
        # the optimizer state, since any rank may update any unit; `state` keeps this rank's static
        # slice of it, under the names and shapes the Gloo path checkpoints
        names = ["momentum"] if g.kind == "muon" else ["exp_avg", "exp_avg_sq"]
        full_state = {n: self.arena.tensor(f"{g.name}.{n}", shape, dtype) for n in names}
        mine = {n: t[self.rank * layout.shard: (self.rank + 1) * layout.shard] for n, t in full_state.items()}
        if g.kind == "muon":
            g.state["momentum"] = mine["momentum"]
        else:
            g.adamw_state([mine["exp_avg"]], [(mine["exp_avg"], mine["exp_avg_sq"])])
        s = SharedGroup(g, layout, param_buf, grad_all, full_state)
        if g.sparse_rows:  # the backward adds its rows into the buffers
            for p, grad in zip(g.params, g.grad_views, strict=True):
                p.grad = grad
            s.rows = TouchedRows(g.params, g.grad_views)
            s.row_marks = self.arena.tensor(f"{g.name}.rows", (self.world_size, shape[0]), torch.bool)
            s.unit_grad = torch.zeros((self._unit_items(layout), *layout.item), dtype=dtype, device=self.opt.device)
            return s
        for p, grad in zip(g.params, g.grad_views, strict=True):
            set_grad_target(p, grad)  # the backward's own GEMMs write into the buffer (grad_target.py)
            p.register_post_accumulate_grad_hook(self._grad_final_hook(grad))
        return s

    @staticmethod
    def _unit_items(layout: FlatLayout) -> int:
        """How many items (rows, elements) an AdamW work unit holds."""
        return max(1, UNIT_ELEMENTS // layout.item_numel)

    def _make_work_queue(self) -> None:
        """The step's work units, largest first (a rank takes the first one that is ready, so the
        small ones are left to even out the end), and the shared tables that hand them out:
        ready_at[rank, parameter] and claimed[unit] hold the step number they were last set in."""
        units = []
        for s in self.shared:
            g, layout = s.group, s.layout
            if g.kind == "muon":
                units += [WorkUnit(s, i, i + 1, [self.param_index[id(g.params[i])]]) for i in range(layout.numel)]
                continue
            per_item, size = layout.item_numel, self._unit_items(layout)
            for lo in range(0, layout.numel, size):
                hi = min(lo + size, layout.numel)
                gate = [self.param_index[id(p)] for p, start in zip(g.params, layout.offsets, strict=True)
                        if start < hi * per_item and lo * per_item < start + p.numel()]
                units.append(WorkUnit(s, lo, hi, gate))
        # the orthogonalisations first: they are the big ones
        units.sort(key=lambda u: (u.group.kind != "muon", -(u.hi - u.lo) * u.shared.layout.item_numel))
        self.units = units
        self.gates = np.zeros((len(units), len(self.param_index)), dtype=bool)
        for i, u in enumerate(units):
            self.gates[i, u.gate] = True
        self.ready_at = self.arena.tensor("ready", (self.world_size, len(self.param_index)), torch.int64).numpy()
        self.claimed = self.arena.tensor("claimed", (len(units),), torch.int64).numpy()
        self.lock = self.arena.lock("queue", self.phase, lambda: self.opt.step_count + 1)
        self.pids = self.arena.tensor("pids", (self.world_size,), torch.int64).numpy()
        self.pids[self.rank] = os.getpid()
        largest = max((u.hi - u.lo) * u.shared.layout.item_numel for u in units if not u.group.sparse_rows)
        self.scratch = torch.zeros(largest, dtype=self.opt.params[0].dtype, device=self.opt.device)

    def _grad_final_hook(self, view: torch.Tensor):
        """Once the last micro-step's gradient of a parameter is complete, put it in its place in
        the shared buffer (if the backward did not write it there itself) and tell the other
        ranks, which may then work on it while this rank's backward goes on."""
        def hook(p: torch.Tensor) -> None:
            if not self.opt.sync_in_backward:
                return
            i, stamp = self.param_index[id(p)], self.opt.step_count + 1
            if self.ready_at[self.rank, i] == stamp:  # other ranks may be updating the weight already
                raise RuntimeError(
                    f"a parameter {tuple(p.shape)} got a second gradient in the last micro-step's backward "
                    f"(a reentrant checkpoint, or a second backward): with ranks sharing memory a gradient "
                    f"must be final when it is first accumulated. Fix: --local-comm gloo")
            self._publish_grad(p, view)
            with self.lock:
                self.ready_at[self.rank, i] = stamp
        return hook

    @staticmethod
    def _publish_grad(p: torch.Tensor, view: torch.Tensor) -> None:
        """Put p's gradient at its place in the shared buffer, unless the backward wrote it there
        itself (grad_target.py); no gradient counts as zero. (p.grad then stays autograd's tensor:
        zero_grad drops it.)"""
        if p.grad is None:
            view.zero_()
        elif p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)

    # ---- the step ----------------------------------------------------------------------------

    def step(self) -> None:
        """Take units from the queue as their gradients become complete on every rank, until none
        is left. A rank whose backward finished early starts on the LM head and the last layers
        while a slower one is still in its backward (their gradients are final: _grad_final_hook),
        instead of waiting for it at a barrier."""
        stamp, polls = self.opt.step_count, 0
        self.last_units_run = 0
        self._publish_rest(stamp)
        while True:
            index = self._claim(stamp)
            if index is None:
                break
            if index < 0:  # every unit left waits for a gradient still being computed
                t0 = time.perf_counter()
                time.sleep(POLL_SECONDS)
                self.comm_wait += time.perf_counter() - t0
                polls += 1
                if polls % PEER_CHECK_POLLS == 0:
                    self._check_peers_alive()
                continue
            self._run_unit(self.units[index])
            self.last_units_run += 1
        # every unit done and every gradient read: the parameters may be used, the gradient
        # buffers written again. Until then no rank reads a parameter (the forward) or a moment
        # (a checkpoint) that another may still be updating.
        t0 = time.perf_counter()
        dist.barrier(group=self.opt.group)
        self.comm_wait += time.perf_counter() - t0

    def _publish_rest(self, stamp: int) -> None:
        """Everything the gradient hooks did not make available: the tables' rows (flagged for the
        units that sum them), dense gradients of a step without sync_in_backward, and parameters
        without a gradient (zero). Then every parameter of this rank is ready."""
        mine = self.ready_at[self.rank]
        for s in self.shared:
            g = s.group
            if s.rows is not None:  # the backward added the rows in already: tell the units which
                s.rows.gather()
                ids, marks = s.rows.dirty(), s.row_marks[self.rank]
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
                                   f"{self.opt.step_count}: this rank waits for its gradients in shared memory")

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
        g, s = u.group, u.shared
        grad = self._sum_table_rows(u) if g.sparse_rows else self._sum_dense(u)
        params = s.param_buf[u.lo: u.hi]
        if g.kind == "muon":
            self.opt.muon(g, params, grad, s.full_state["momentum"][u.lo: u.hi])
        else:
            self.opt.adamw(g, [params], [grad], [s.full_state["exp_avg"][u.lo: u.hi]],
                           [s.full_state["exp_avg_sq"][u.lo: u.hi]])

    def _sum_dense(self, u: WorkUnit) -> torch.Tensor:
        """The unit's gradient summed over ranks, in rank order whoever sums it (the same bits on
        any rank), into this rank's private scratch: the shared buffers are only read."""
        layout = u.shared.layout
        n = layout.item_numel
        a, b = u.lo * n, u.hi * n
        parts = [grads.view(-1)[a:b] for grads in u.shared.grad_all]
        out = self.scratch[: b - a]
        torch.add(parts[0], parts[1], out=out)
        for part in parts[2:]:
            out.add_(part)
        return out.view(u.hi - u.lo, *layout.item)

    def _sum_table_rows(self, u: WorkUnit) -> torch.Tensor:
        """The unit's rows of a table's summed gradient, from only the rows some rank touched (a
        few hundred of the table's tens of thousands); the other rows of unit_grad stay zero."""
        s = u.shared
        ids = s.row_marks[:, u.lo: u.hi].any(dim=0).nonzero().squeeze(1)
        grad, rows = s.unit_grad[: u.hi - u.lo], s.grad_all[:, u.lo: u.hi]
        if ids.numel() > (u.hi - u.lo) // 4:  # many rows (a dense gradient flags all): whole runs are cheaper
            torch.sum(rows, dim=0, out=grad)
            s.unit_rows = None
            return grad
        if s.unit_rows is None:
            s.unit_grad.zero_()
        else:
            s.unit_grad.index_fill_(0, s.unit_rows, 0)  # the rows the last unit wrote
        summed = rows[0].index_select(0, ids)
        for r in range(1, self.world_size):
            summed.add_(rows[r].index_select(0, ids))
        grad.index_copy_(0, ids, summed)
        s.unit_rows = ids
        return grad

    def zero_grad(self) -> None:
        for s in self.shared:
            if s.rows is None:  # written afresh into the buffer by the next backward
                clear_gradients(s.group.params)
                continue
            s.rows.clear()
            s.row_marks[self.rank].zero_()  # every unit has read them (the step's barrier)

    # ---- checkpointing -----------------------------------------------------------------------

    def load_state(self, g: Group, saved: dict[str, torch.Tensor]) -> None:
        """Into this rank's slice of the shared state. No other rank reads it before this rank's
        gradients of the next step are ready (_claim), which is after the load returns."""
        # a Gloo rank that owns no matrix of a group saves no state for it: zeros, as here
        mismatch = [k for k in saved.keys() | g.state.keys() if saved and (
            k not in saved or k not in g.state or saved[k].shape != g.state[k].shape)]
        if mismatch:
            raise ValueError(f"optimizer shard of group {g.name} does not fit this optimizer ({sorted(mismatch)}): "
                             f"not a checkpoint of this run's optimizer; start a new run (another --run-name)")
        for k, v in saved.items():
            g.state[k].copy_(v)
