"""Local steps across nodes, an outer sync every H steps (DiLoCo; with Muon inside, MuLoCo).

A node is one launcher (torchrun `--node-rank`): its ranks share a host. With `--sync-every H`,
H > 1, each node trains alone for H inner steps: its ranks step together as they would alone (the
inner optimizer is `MuonAdamW` over the node's ranks only: shared memory, or Gloo within the node),
and nothing crosses between nodes. Then, at the outer boundary, the nodes meet once:

    delta_n     = theta_global - theta_n          (node n's pseudo-gradient: how far it moved)
    delta       = sum_n  w_n * delta_n            (w_n: node n's share of the phase's tokens)
    m           = mu * m + delta                  (outer momentum)
    theta_global = theta_global - lr * (delta + mu * m)    (Nesterov)

and every node restarts its inner phase from the new theta_global, keeping its inner optimizer
state. With --outer-lr 1 --outer-momentum 0 the outer step is the token-weighted average of the
nodes' parameters. The token weights keep the speed split working: a fast node does more rows
per inner step, so its progress counts for more.

The outer state is sharded like ZeRO over the nodes' first ranks ("leaders"): each leader owns
an equal slice of the flat parameter vector. An all-to-all gives every leader every node's
delta of its slice (Gloo's reduce-scatter would cost an all-reduce's bytes), it updates its slice
and its slice of the momentum, and an all-gather returns theta_global to every leader, in fp32
or (--param-comm-dtype bfloat16) as bf16-rounded updates that every leader adds alike, so
theta_global stays bit-identical on every node. Deltas travel in --grad-comm-dtype. The leader
then hands theta_global to its node's other ranks (shared memory: they read the same weights;
Gloo within the node: a broadcast).

With --outer-compress (outer_codec.py) both halves travel quantized instead, int8 or int4 with a
scale per block of values: each leader quantizes its weighted delta plus what it did not send last time
(its residual, error feedback), and each owner its slice's update plus its own residual; every
leader adds the same decoded updates, so theta_global stays bit-identical. The residuals are
checkpointed with the momentum; on another set of nodes the deltas' residuals are summed and
shared out equally (their sum is what is still owed), the updates' joined as slices.

Local steps cost the most quality early, while the model changes fastest (Lin et al.'s post-local
SGD; DiLoCo itself starts from a pretrained model): the trainer runs the first --sync-warmup-ratio
of the steps synchronously, checkpoints, and every node then continues the whole synchronous
optimizer state (local_steps.py). OuterSchedule's `start` is that step.

Per outer step each leader sends (nodes - 1) / nodes of the model twice, where ZeRO-2 sends
about that every step: H times fewer bytes. When the nodes meet, how often, and whether a sync
overlaps the next inner steps is outer_policy.py's to choose (auto's rules), and local_steps.py
asks it each step.

With --outer-overlap on, an outer sync need not hold the nodes at all: each leader sends its
delta from a thread of its own, on a process group of its own (`Background`), and its node
trains on from its own weights. The sync lands `land_after` inner steps later (`landing_steps`:
1.5 times the steps the run's first, blocking sync took; at the latest at the next boundary):
the node's weights become theta_n - base + theta_global, its progress since it sent (base: its
weights then) on the theta_global the sync brought, and the next delta is that progress. So a
node's own progress of a phase stands in for the nodes' average of it for those few steps
(Streaming DiLoCo's overlap). What reads or saves the model needs every node at theta_global:
before an evaluation, a sample, a checkpoint, a stop and the last step the sync blocks as above
(the one in flight lands first), so a checkpoint never holds a sync in flight. The thread
compares theta_global's bits across the leaders after each sync, as the loop compares the
parameters after a blocking one.
"""

from __future__ import annotations

import datetime
import math
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .dist import EXIT_MISMATCH, DistEnv, Watchdog, fail, node_index
from .outer_codec import BlockCodec, send_with_feedback
from .perf import sync
from .sync_strategy import all_gather, wait_timed

# ---- which ranks form a node ---------------------------------------------------------------------

@dataclass
class Nodes:
    """The run's nodes and the process groups local steps need."""

    index: int  # this rank's node
    ranks: list[list[int]]  # every node's ranks, by node
    group: dist.ProcessGroup | None  # this node's ranks (None: the node has one rank, it steps alone)
    leaders: dist.ProcessGroup | None  # every node's first rank (None: the world, one rank per node)
    rank: int  # this rank's global rank
    background: Background | None = None  # where overlapped outer syncs go (--outer-overlap on or auto)

    @property
    def count(self) -> int:
        return len(self.ranks)

    @property
    def size(self) -> int:
        """Ranks on this node."""
        return len(self.ranks[self.index])

    @property
    def rank_in_node(self) -> int:
        return self.ranks[self.index].index(self.rank)

    @property
    def leader(self) -> bool:
        return self.rank_in_node == 0


def find_nodes(env: DistEnv, watchdog: Watchdog) -> Nodes:
    """Group the ranks by launcher (dist.node_index: several launchers on one host are separate
    nodes); collective: every rank builds every group, in the same order."""
    mine = node_index()
    everyone: list[int | None] = [None] * env.world_size
    with watchdog.phase("all_gather node ranks", 0):
        dist.all_gather_object(everyone, mine)
    by_node: dict[int, list[int]] = {}
    for rank, node in enumerate(everyone):
        by_node.setdefault(int(node), []).append(rank)
    ranks = [by_node[n] for n in sorted(by_node)]
    index = sorted(by_node).index(mine)
    group = leaders = None
    if any(len(r) > 1 for r in ranks):
        with watchdog.phase("new process groups for the nodes", 0):
            mine_group, _ = dist.new_subgroups_by_enumeration(ranks)
            group = mine_group if len(ranks[index]) > 1 else None
            leaders = dist.new_group([r[0] for r in ranks])
    return Nodes(index, ranks, group, leaders, env.rank)


@dataclass
class Background:
    """What an outer sync needs to go on while the inner steps do: the leaders' own process group
    (the loop's collectives go on beside it, on the world's and the node's groups) and a watchdog
    of its own (the loop's keeps the loop's phases)."""

    env: DistEnv
    group: dist.ProcessGroup
    watchdog: Watchdog = field(repr=False)


def open_background(env: DistEnv, nodes: Nodes, watchdog: Watchdog, timeout_s: float) -> Background:
    """Collective: every rank builds the group, the others' ranks a handle they never use."""
    with watchdog.phase("new process group for overlapped outer syncs", 0):
        group = dist.new_group([r[0] for r in nodes.ranks], timeout=datetime.timedelta(seconds=timeout_s))
    return Background(env, group, Watchdog(env, watchdog.bound_s))


def node_token_share(nodes: Nodes, sizes: list[int]) -> float:
    """This node's share of an inner step's tokens: its ranks' rows over every rank's."""
    return sum(sizes[r] for r in nodes.ranks[nodes.index]) / sum(sizes)


# ---- the outer step ------------------------------------------------------------------------------

@dataclass
class OuterStats:
    sync_s: float  # the whole outer step, as this rank saw it (overlapped: its part between two steps)
    wait_s: float  # of which blocked on the wire (and on the slower nodes; overlapped: on the sync before)
    pseudo_grad_norm: float  # of the nodes' weighted delta (overlapped: the sync that landed; nan: none did)
    sent_bytes: int  # by this node's leader
    slowest_step_s: float  # the slowest node's mean inner step in the phase that ended (overlapped: landed)
    background_s: float = 0.0  # overlapped: how long the sync that landed took in the background
    overlapped: bool = False  # this one left in the background: the nodes are not at theta_global
    cpu_s: float = 0.0  # the CPU time this process took meanwhile, every thread's (a sync's thread's too)
    landed: Landed | None = None  # blocking: an overlapped sync that landed first (leaders only)


@dataclass
class Landed:
    """An overlapped sync, once done: what its leaders agreed on."""

    took_s: float
    norm_sq: float
    slowest_step_s: float


class DiLoCo:
    phase = "outer sync (pseudo-gradient all-to-all, parameter all-gather)"

    def __init__(self, model: torch.nn.Module, nodes: Nodes, token_share: float, outer_lr: float,
                 outer_momentum: float, grad_dtype: torch.dtype, param_dtype: torch.dtype,
                 shared_params: bool, codec: BlockCodec | None = None):
        self.params = list(model.parameters())
        self.codec = codec  # --outer-compress: both halves quantized, with error feedback (None: the dtypes)
        self.nodes, self.weight = nodes, token_share  # weight: the node's share where no step was counted
        self.rows = [0, 0]  # this node's rows and every node's, over the inner steps since the last sync
        self.lr, self.mu = outer_lr, outer_momentum
        self.grad_dtype, self.param_dtype = grad_dtype, param_dtype
        self.shared_params = shared_params  # the node's ranks read one copy of the weights (shared memory)
        # whether the outer syncs cross in the background (a Background is needed); None: --outer-overlap
        # auto has not chosen yet, and they block
        self.overlaps: bool | None = nodes.background is not None
        self.outer_steps = 0
        self.wait_s = 0.0  # of the last outer step
        self.crossing_s = 0.0  # how long the last sync took to cross (its exchange, or in the background; leaders)
        self.flight: threading.Thread | None = None  # an overlapped sync under way (leaders only)
        self.lands_at: int | None = None  # the step it lands at, mid-phase (every rank of the node knows)
        self.landed: Landed | None = None  # what it agreed on, once done
        self.numel = sum(p.numel() for p in self.params)
        self.shard = -(-self.numel // nodes.count)
        device = self.params[0].device
        self.lo = nodes.index * self.shard
        if not nodes.leader:
            return
        full = self.shard * nodes.count  # padded: the last slice's tail is zeros on every node
        self.theta = torch.zeros(full, dtype=torch.float32, device=device)  # theta_global
        self.flatten_into(self.theta)
        self.local = torch.zeros_like(self.theta)  # theta_n, then the weighted delta
        self.momentum = torch.zeros(self.shard, dtype=torch.float32, device=device)
        self.new_slice = torch.zeros(self.shard, dtype=torch.float32, device=device)
        # error feedback: what the codec dropped of this node's delta (every slice) and of the
        # updates of the slice it owns, sent with the next ones. Without a codec they are None, but
        # for a resume from a compressed run's checkpoint: then they go with the next sync, once
        self.residual: torch.Tensor | None = None
        self.update_residual: torch.Tensor | None = None
        # the wire's buffers, (send, receive, updates): the codec's bytes, and the dtypes' values (with
        # a codec only for the run's last sync, which is sent exactly: allocated then)
        self.packed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.wire: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None
        if codec is not None:
            payload = torch.empty(codec.row_bytes(self.shard) * nodes.count, dtype=torch.uint8, device=device)
            self.packed = (payload, torch.empty_like(payload), torch.empty_like(payload))  # a row per slice
            self.residual = torch.zeros_like(self.theta)
            self.update_residual = torch.zeros_like(self.momentum)
        else:
            self._plain()
        # overlapped: the weights this node's phase began from, which the sync in flight will replace
        # (allocated by the first overlapped sync: --outer-overlap auto may never overlap)
        self.base: torch.Tensor | None = None

    def count(self, sizes: list[int], accum: int) -> None:
        """One inner step of `accum` micro-steps at the split `sizes` (rows per rank). The split may
        change inside a phase (checked again once the inner steps begin; a new split may take
        another number of micro-steps): each node's delta is weighed by the rows it really did in
        the phase, and a phase at one split gets exactly node_token_share."""
        self.rows[0] += sum(sizes[r] for r in self.nodes.ranks[self.nodes.index]) * accum
        self.rows[1] += sum(sizes) * accum

    def phase_share(self) -> float:
        """This node's share of the tokens of the phase that ends, and the count starts anew."""
        share = self.rows[0] / self.rows[1] if self.rows[1] else self.weight
        self.rows = [0, 0]
        return share

    def flatten_into(self, flat: torch.Tensor) -> None:
        offset = 0
        for p in self.params:
            flat[offset: offset + p.numel()].copy_(p.detach().reshape(-1))
            offset += p.numel()

    def load_from(self, flat: torch.Tensor) -> None:
        offset = 0
        for p in self.params:
            p.copy_(flat[offset: offset + p.numel()].view_as(p))
            offset += p.numel()

    def _plain(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The buffers for the deltas and updates in --grad-comm-dtype and --param-comm-dtype (updates
        None: theta_global's slices themselves travel, fp32)."""
        if self.wire is None:
            recv = torch.empty_like(self.theta, dtype=self.grad_dtype)
            send = self.local if self.grad_dtype == torch.float32 else torch.empty_like(recv)
            updates = (None if self.param_dtype == torch.float32
                       else torch.empty_like(self.theta, dtype=self.param_dtype))
            self.wire = (send, recv, updates)
        return self.wire

    @property
    def sent_bytes(self) -> int:
        return self.wire_bytes()

    def wire_bytes(self, exact: bool = False) -> int:
        """What a leader sends per outer step: the others' slices of its delta, then its own slice
        of theta_global (or of its rounded update) to every other leader; `exact`: the run's last."""
        if self.codec is not None and not exact:
            return (self.nodes.count - 1) * 2 * self.codec.row_bytes(self.shard)
        others = (self.nodes.count - 1) * self.shard
        return others * (self.grad_dtype.itemsize + self.param_dtype.itemsize)

    @torch.no_grad()
    def outer_step(self, mean_step_s: float, step: int = 0, overlap: bool = False,
                   land_at: int | None = None, exact: bool = False) -> OuterStats:
        """Collective over every rank; `mean_step_s` is this rank's mean inner step of the phase.

        Blocking (the default), every node is at theta_global when it returns (an overlapped sync
        still in flight lands first). `overlap` (a Background): the nodes' deltas leave in a thread
        and each node trains on from its own weights; the sync lands at step `land_at` (`land`, a
        collective over the node's ranks) or else at the next outer step, and rebases the node's
        weights on the theta_global it brought (`_land`). Until then a node's own progress of the
        phase stands in for the nodes' average of it (Streaming DiLoCo's overlap). `exact` (the run's
        last, blocking): with a codec, sent in the dtypes instead, with what the codec still owes, so
        the model the run ends with holds no rounding of its last sync (the inner steps after a
        quantized sync recover from its rounding; a run's end has none after it)."""
        assert not (overlap and exact), "the run's last sync blocks"
        share = self.phase_share()  # every rank's count starts anew
        t0, cpu0 = time.perf_counter(), time.process_time()  # the process's CPU: its Gloo threads' too
        self.wait_s = 0.0
        # (squared norm of the delta's slice, mean inner step, seconds in the background): summed,
        # maxed and maxed over the nodes
        stats = torch.tensor([0.0, mean_step_s, 0.0], dtype=torch.float64, device=self.params[0].device)
        landed = self._land() if self.nodes.leader else None  # the sync in flight, if any, lands first
        if self.nodes.leader:
            if overlap:
                self._launch(share, mean_step_s, step, land_at)
                stats = torch.tensor([math.nan, mean_step_s, 0.0] if landed is None else
                                     [landed.norm_sq, landed.slowest_step_s, landed.took_s],
                                     dtype=torch.float64, device=stats.device)
            else:
                stats[0] = self._leader_step(share, exact)
                everyone = torch.empty(self.nodes.count * 3, dtype=torch.float64, device=stats.device)
                self._wait(all_gather(everyone, stats, group=self.nodes.leaders, async_op=True))
                rows = everyone.view(self.nodes.count, 3)
                stats = torch.stack([rows[:, 0].sum(), rows[:, 1].max(), rows[:, 2].max()])
        if self.nodes.group is not None:  # the node's other ranks: the weights, and the stats to agree on H
            if not self.shared_params:
                for p in self.params:
                    self._wait(dist.broadcast(p.data, group=self.nodes.group, group_src=0, async_op=True))
            self._wait(dist.broadcast(stats, group=self.nodes.group, group_src=0, async_op=True))
        self.outer_steps += 1
        self.lands_at = land_at if overlap else None
        sync(self.params[0].device)
        return OuterStats(time.perf_counter() - t0, self.wait_s, float(stats[0]) ** 0.5,
                          self.wire_bytes(exact) if self.nodes.leader else 0, float(stats[1]), float(stats[2]), overlap,
                          time.process_time() - cpu0, None if overlap else landed)

    def _leader_step(self, share: float, exact: bool = False) -> float:
        """The outer update of this leader's slice, theta_global back on every leader and in this
        node's weights; returns the squared norm of the delta in this slice."""
        self.flatten_into(self.local)
        self._delta(share, exact)
        t0 = time.perf_counter()
        norm_sq, waited = self._exchange(self.nodes.leaders, exact)
        self.crossing_s = time.perf_counter() - t0
        self.wait_s += waited
        self.load_from(self.theta)
        return norm_sq

    def stop_s(self) -> float:
        """At a boundary, what the outer syncs add to a stop beyond that boundary step's own time
        (StopBudget). Where its sync blocked, that step's time holds a crossing already, as the
        stop's own sync will take. Where its sync left in the background it does not, and a stop
        before that sync lands waits for it, then blocks on its own: two crossings, each as long as
        the last one took (leaders; the others' figure is never said)."""
        return 2 * self.crossing_s if self.flight is not None else 0.0

    def _delta(self, share: float, exact: bool = False) -> None:
        """This node's weighted delta, theta_global - theta_n (theta_n in self.local), ready to send:
        with a codec, quantized with what it dropped before (error feedback); `exact`, in the dtypes
        with what the codec still owes."""
        delta = torch.sub(self.theta, self.local, out=self.local).mul_(share)
        if self.codec is not None and not exact:
            rows = self.nodes.count
            send_with_feedback(self.codec, delta.view(rows, self.shard), self.residual, self.packed[0].view(rows, -1))
            return
        if self.residual is not None:  # owed: the run's last sync, or a compressed run resumed without a codec
            delta.add_(self.residual)
            self.residual = self.residual.zero_() if self.codec is not None else None
        send = self._plain()[0]
        if send is not delta:
            send.copy_(delta)

    def _exchange(self, group: dist.ProcessGroup | None, exact: bool = False) -> tuple[float, float]:
        """The nodes' deltas summed for this leader's slice, its outer update, and theta_global whole
        again on every leader; returns the squared norm of the summed slice and the seconds waited."""
        device = self.params[0].device
        count, codec = self.nodes.count, None if exact else self.codec
        send, recv, updates = self.packed if codec is not None else self._plain()
        waited = wait_timed(dist.all_to_all_single(recv, send, group=group, async_op=True), device)
        if codec is None:
            summed = torch.sum(recv.view(count, self.shard), dim=0, dtype=torch.float32)
        else:  # a node's row at a time, in node order: the same sum on every leader
            summed = torch.zeros(self.shard, dtype=torch.float32, device=device)
            for row in recv.view(count, 1, -1):
                summed.add_(codec.decode(row, self.shard)[0])
        norm_sq = float(summed.double().square().sum())
        self.momentum.mul_(self.mu).add_(summed)
        step = summed.add_(self.momentum, alpha=self.mu).mul_(-self.lr)  # Nesterov: delta + mu m
        owned = self.theta[self.lo: self.lo + self.shard]
        if codec is not None:  # every leader, the owner too, adds the same decoded updates: theta stays identical
            payload = send_with_feedback(codec, step.view(1, self.shard), self.update_residual)
            waited += wait_timed(all_gather(updates, payload.view(-1), group=group, async_op=True), device)
            for owner, row in enumerate(updates.view(count, 1, -1)):
                self.theta[owner * self.shard: (owner + 1) * self.shard].add_(codec.decode(row, self.shard)[0])
            return norm_sq, waited
        if self.update_residual is not None:  # owed, as the delta's residual
            step.add_(self.update_residual)
            self.update_residual = self.update_residual.zero_() if self.codec is not None else None
        if updates is None:
            torch.add(owned, step, out=self.new_slice)
            waited += wait_timed(all_gather(self.theta, self.new_slice, group=group, async_op=True), device)
        else:  # every leader, the owner too, adds the same rounded update: theta stays identical
            waited += wait_timed(all_gather(updates, step.to(self.param_dtype), group=group, async_op=True), device)
            self.theta.add_(updates)
        return norm_sq, waited

    # ---- overlapped: the sync crosses while the next phase trains ------------------------------------

    def _launch(self, share: float, mean_step_s: float, step: int, land_at: int | None) -> None:
        """Send this node's delta of the phase that ended in the background; this node trains on from
        its weights as they are, which the next outer step rebases (`base` remembers them)."""
        if self.base is None:
            self.base = torch.zeros_like(self.theta)
        self.flatten_into(self.base)
        self.local.copy_(self.base)
        self._delta(share)
        self.landed = None
        self.flight = threading.Thread(target=self._fly, args=(mean_step_s, step, self.outer_steps + 1, land_at),
                                       name=f"outer-sync-{self.outer_steps + 1}", daemon=True)
        self.flight.start()

    def _fly(self, mean_step_s: float, step: int, number: int, land_at: int | None) -> None:
        """The thread: the exchange on the background group, then the leaders' stats and a bitwise
        checksum of theta_global (every leader must hold the same; a mismatch stops every rank)."""
        t0 = time.perf_counter()
        line = self.nodes.background
        # the step named: where it was meant to land (a stall then is the wire's, not the loop's)
        with line.watchdog.phase(f"{self.phase}, outer step {number} in the background of the inner steps",
                                 land_at or step):
            norm_sq, _ = self._exchange(line.group)
            # theta's bits summed as integers: exact, the same on any CPU (a float sum's order is not)
            bits = int(self.theta.view(torch.int32).sum(dtype=torch.int64)) % (1 << 50)
            stats = torch.tensor([norm_sq, mean_step_s, float(bits)], dtype=torch.float64, device=self.theta.device)
            everyone = torch.empty(self.nodes.count * 3, dtype=torch.float64, device=self.theta.device)
            all_gather(everyone, stats, group=line.group)
        rows = everyone.view(self.nodes.count, 3)
        differ = [n for n in range(self.nodes.count) if rows[n, 2] != rows[0, 2]]
        if differ:
            hosts = line.env.hosts
            fail(line.env, EXIT_MISMATCH,
                 f"theta_global diverged across nodes after outer step {number} (overlapped, from step {step}): "
                 + "; ".join(f"node {n} (rank {self.nodes.ranks[n][0]}@{hosts[self.nodes.ranks[n][0]]}) differs "
                             f"from node 0's" for n in differ)
                 + ". The nodes are no longer training the same model; stopping every rank.")
        self.landed = Landed(time.perf_counter() - t0, float(rows[:, 0].sum()), float(rows[:, 1].max()))

    @torch.no_grad()
    def land(self) -> tuple[Landed | None, float]:
        """At `lands_at`, between two outer steps: the overlapped sync lands (`_land`); collective over
        the node's ranks (the others get the rebased weights). Returns what it agreed on (the
        node's other ranks: None) and the seconds this rank waited for it."""
        self.wait_s = 0.0
        landed = self._land() if self.nodes.leader else None
        if self.nodes.group is not None:
            if not self.shared_params:
                for p in self.params:
                    self._wait(dist.broadcast(p.data, group=self.nodes.group, group_src=0, async_op=True))
            else:  # the others read the shared weights once the leader has rebased them
                self._wait(dist.broadcast(torch.zeros(1, device=self.params[0].device), group=self.nodes.group,
                                          group_src=0, async_op=True))
        self.lands_at = None
        sync(self.params[0].device)
        return landed, self.wait_s

    def _land(self) -> Landed | None:
        """The overlapped sync in flight, if any: wait for it, then rebase this node's weights on the
        theta_global it brought, theta_n - base + theta_global: the node keeps its progress since it
        left, and the nodes' average replaces its own progress of the phase before."""
        if self.flight is None:
            return None
        t0 = time.perf_counter()
        self.flight.join()
        self.wait_s += time.perf_counter() - t0
        self.flight = None
        if self.landed is not None:
            self.crossing_s = self.landed.took_s
        self.flatten_into(self.local)
        self.local.sub_(self.base).add_(self.theta)
        self.load_from(self.local)
        return self.landed

    def _wait(self, work: dist.Work) -> None:
        self.wait_s += wait_timed(work, self.params[0].device)

    # ---- checkpointing: theta_global is the model at a boundary; each leader keeps its slice --------

    def state_dict(self) -> dict:
        assert self.flight is None, "a checkpoint is taken only where every node is at theta_global"
        state = {"nodes": self.nodes.count, "node": self.nodes.index, "outer_steps": self.outer_steps}
        if self.nodes.leader:
            state["momentum"] = self.momentum.clone()
            if self.residual is not None:  # unpadded: merge_outer_states sums them over the nodes
                state["residual"] = self.residual[: self.numel].clone()
            if self.update_residual is not None:
                state["update_residual"] = self.update_residual.clone()
        return state

    def load_state_dict(self, state: dict) -> None:
        """This node's own saved state, or (another set of nodes) `merge_outer_states`'s whole one."""
        if state.get("format") == "whole":
            self.outer_steps = state["outer_steps"]
            if self.nodes.leader:
                mine = state["momentum"][self.lo: self.lo + self.shard]
                self.momentum.zero_()[: mine.numel()].copy_(mine)
                if "residual" in state:  # the old nodes' summed residual, in equal parts: the sum goes on
                    self._load_residuals(state["residual"] / self.nodes.count, None)
                if "update_residual" in state:
                    self._load_residuals(None, state["update_residual"][self.lo: self.lo + self.shard])
            return
        if (state["nodes"], state["node"]) != (self.nodes.count, self.nodes.index):
            raise ValueError(
                f"the outer momentum was saved by node {state['node']} of {state['nodes']}, this is node "
                f"{self.nodes.index} of {self.nodes.count}: a checkpoint of another set of "
                f"nodes is merged first (checkpoint.load_states)")
        self.outer_steps = state["outer_steps"]
        if self.nodes.leader:
            self.momentum.copy_(state["momentum"])
            self._load_residuals(state.get("residual"), state.get("update_residual"))

    def _load_residuals(self, residual: torch.Tensor | None, update_residual: torch.Tensor | None) -> None:
        """A checkpoint's error feedback, into this leader's residuals (allocated where this run
        has no codec: they are sent with the next sync, once)."""
        if residual is not None:
            if self.residual is None:
                self.residual = torch.zeros_like(self.theta)
            self.residual.zero_()[: residual.numel()].copy_(residual)
        if update_residual is not None:
            if self.update_residual is None:
                self.update_residual = torch.zeros_like(self.momentum)
            self.update_residual.zero_()[: update_residual.numel()].copy_(update_residual)


def merge_outer_states(saved: list[dict]) -> dict:
    """The whole outer state from every old node's leader's `state_dict()`, for a resume on another
    set of nodes: the momentum slices joined in node order (the padding at the end stays zeros)."""
    slices = sorted(saved, key=lambda s: s["node"])
    if [s["node"] for s in slices] != list(range(slices[0]["nodes"])) or any("momentum" not in s for s in slices):
        raise ValueError(f"outer states of nodes {[s['node'] for s in slices]} of {slices[0]['nodes']}: merging "
                         f"needs every node's first rank's")
    momentum = torch.cat([s["momentum"] for s in slices])
    whole = {"format": "whole", "outer_steps": slices[0]["outer_steps"], "momentum": momentum}
    # error feedback: what the codec has not yet sent of the nodes' deltas sums over the nodes (each
    # is already weighted by its node's share), and the updates' residuals are slices like momentum
    owed = [s["residual"] for s in slices if "residual" in s]
    if owed:  # summed one at a time: a stack would hold every node's copy of the model at once
        whole["residual"] = owed[0].clone()
        for residual in owed[1:]:
            whole["residual"].add_(residual)
    if any("update_residual" in s for s in slices):
        whole["update_residual"] = torch.cat([s.get("update_residual", torch.zeros_like(s["momentum"]))
                                              for s in slices])
    return whole

