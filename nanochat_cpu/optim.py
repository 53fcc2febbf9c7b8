"""Muon for the block matrices, AdamW for everything else; one optimizer for 1 and N ranks.

This module holds the update math (Newton-Schulz orthogonalisation, Muon, fused AdamW), the
parameter groups and `MuonAdamW`, a thin front that the trainer drives. How gradients,
parameters and optimizer state cross between ranks around the math is the job of a sync
strategy (sync_strategy.py), picked here by the shape of the run:

- one process: `LocalSync` (sync_local.py), nothing to communicate;
- N ranks through the process group: `Zero2Sync` (sync_zero2.py), ZeRO-2 reduce-scatter of the
  gradients, each rank updating the slice it owns, all-gather of the parameters;
- N ranks of one host sharing memory (`shm.SharedArena`): `SharedMemorySync` (sync_shared.py),
  the step a queue of work units that any rank takes as soon as their gradients are complete.

Gradients are *summed* across ranks: the trainer scales each rank's loss by its share of the
global batch's tokens, so uneven per-rank batches still give the global mean gradient.
"""

from __future__ import annotations

import torch

from .grad_target import set_grad_target
from .shm import SharedArena
from .sync_local import LocalSync
from .sync_shared import SharedMemorySync
from .sync_strategy import WHOLE_KEYS, WIRE_DTYPES, FlatLayout, Group, SyncStrategy, layout_record
from .sync_zero2 import Zero2Sync

# Quintic Newton-Schulz coefficients (Keller Jordan, modded-nanogpt): maximise the slope at
# zero so 5 iterations push all singular values into roughly [0.7, 1.2].
NS_COEFFS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5


# An fp32 (m x n) matrix with n >= GRAM_ASPECT * m is orthogonalised through its (m x m) Gram matrix
# (orthogonalize_via_gram): 4mmn + 34mmm FLOPs against 20mmn + 10mmm, so it pays from n = 1.5m and
# takes 44% off the MLP's (d x 4d) matrices, where fp32 Newton-Schulz costs most without native bf16.
GRAM_ASPECT = 2


def orthogonalize(g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Approximate U V^T of a stack of matrices (k, m, n) by Newton-Schulz iteration.

    Each iteration is X <- p(X X^T) X with p(G) = a + bG + cG^2. The polynomial's scalings ride in
    baddbmm's alpha/beta, so an iteration is three GEMMs and no separate elementwise passes (which
    on CPU cost as much as the GEMMs at these sizes).
    """
    x = g.to(dtype)
    transposed = x.size(-2) > x.size(-1)
    if transposed:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    if x.dtype == torch.float32 and x.size(-1) >= GRAM_ASPECT * x.size(-2):
        x = orthogonalize_via_gram(x)
    else:
        a, b, c = NS_COEFFS
        for _ in range(NS_STEPS):
            gram = torch.bmm(x, x.mT)
            poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)  # b*G + c*G@G
            x = torch.baddbmm(x, poly, x, beta=a, alpha=1.0)  # a*X + P@X
    if transposed:
        x = x.mT
    return x.to(g.dtype)


def orthogonalize_via_gram(x: torch.Tensor) -> torch.Tensor:
    """The same iteration for wide (k, m, n) stacks, n > m, done on (m x m) matrices.

    Every iterate is Q X0 with Q a polynomial in G0 = X0 X0^T, so Q and the Gram matrix
    G = Q G0 Q^T commute: p(G) Q is the next Q and p(G)^2 G the next G. Only the first and last
    GEMMs touch the wide X0. In exact arithmetic the result is the one above; in fp32 it agrees to
    ~1e-5 (tests/test_dist_optim.py). fp32 only: Q's entries grow to a^5 ~ 480 along the smallest
    singular directions, and bf16's rounding of them would not stay small as the plain iteration's does.
    """
    a, b, c = NS_COEFFS
    gram = torch.bmm(x, x.mT)
    q = None
    for i in range(NS_STEPS):
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)  # b*G + c*G@G
        poly.diagonal(dim1=-2, dim2=-1).add_(a)  # + a*I
        q = poly if q is None else torch.bmm(poly, q)
        if i < NS_STEPS - 1:
            gram = torch.bmm(poly, torch.bmm(poly, gram))
    return torch.bmm(q, x)


class MuonAdamW:
    def __init__(self, groups: list[Group], rank: int = 0, world_size: int = 1,
                 muon_dtype: torch.dtype = torch.float32, comm_dtype: torch.dtype = torch.float32,
                 param_comm_dtype: torch.dtype = torch.float32, arena: SharedArena | None = None,
                 group: torch.distributed.ProcessGroup | None = None):
        self.groups = groups
        self.device = groups[0].params[0].device
        # the ranks that step together: the world, or with local steps (sync_diloco.py) one node's
        # ranks; `rank` and `world_size` are within it
        self.rank, self.world_size, self.group = rank, world_size, group
        self.muon_dtype = muon_dtype
        self.arena = arena  # ranks on one host: buffers in shared memory, nothing on the wire
        self.step_count = 0
        # Set by the trainer around the last micro-step's backward: dense groups then start their
        # reduce-scatter from gradient hooks, or (shared memory) other ranks may update a parameter
        # as soon as its gradient is complete. So its gradients must be final when accumulated and
        # left as they are until step() (no clipping in between). Left False, step() starts everything.
        self.sync_in_backward = False
        self.params = [p for g in groups for p in g.params]
        for g in groups:
            if g.kind == "muon":
                shapes = {tuple(p.shape) for p in g.params}
                assert len(shapes) == 1, f"muon group {g.name} mixes shapes {shapes}"
            elif g.sparse_rows:
                widths = {tuple(p.shape[1:]) for p in g.params}
                assert all(p.dim() == 2 for p in g.params) and len(widths) == 1, f"{g.name}: tables differ {widths}"
        for p in self.params:  # an earlier optimizer's shared buffer, if any, is not this one's
            set_grad_target(p, None)
        self.sync: SyncStrategy
        if world_size == 1:
            self.sync = LocalSync(self)
        elif arena is None:
            # gradients may travel in bf16, parameters as bf16-rounded updates (sync_zero2.py)
            self.sync = Zero2Sync(self, comm_dtype, param_comm_dtype)
        else:
            self.sync = SharedMemorySync(self, arena)

    # ---- the step: the sync strategy around the update math ----------------------------------

    @property
    def step_phase(self) -> str:
        """What step() waits on, for the watchdog's message when it hangs or fails."""
        return self.sync.phase

    @property
    def last_comm_wait(self) -> float:
        """Seconds the last step spent blocked on communication."""
        return self.sync.comm_wait

    @torch.no_grad()
    def step(self) -> None:
        self.step_count += 1
        self.sync_in_backward = False
        self.sync.comm_wait = 0.0
        self.sync.step()

    def zero_grad(self) -> None:
        """Call after every step (model.zero_grad() is not enough): it clears the tables' touched
        rows and this rank's row flags, which would otherwise pile up step after step."""
        self.sync.zero_grad()

    def adamw(self, g: Group, params: list[torch.Tensor], grads: list[torch.Tensor],
              m: list[torch.Tensor], v: list[torch.Tensor]) -> None:
        b1, b2 = g.betas
        lr = g.lr * g.lr_multiplier
        # one fused, vectorised pass over memory (the embeddings dominate the optimizer's bytes)
        # the step counts live with the parameters: the CUDA kernel reads them on the device
        steps = [torch.tensor(float(self.step_count), dtype=torch.float32, device=p.device) for p in params]
        torch._fused_adamw_(params, grads, m, v, [], steps, lr=lr, beta1=b1, beta2=b2,
                            weight_decay=g.weight_decay, eps=g.eps, amsgrad=False, maximize=False)

    def muon(self, g: Group, params: torch.Tensor | list[torch.Tensor], grads: torch.Tensor,
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

    # ---- the shared-memory strategy's work queue, as the tests read it -------------------------

    @property
    def units(self) -> list:
        return self.sync.units

    @property
    def claimed(self):
        return self.sync.claimed

    @property
    def last_units_run(self) -> int:
        return self.sync.last_units_run

    # ---- checkpointing: each rank saves its own shard; any layout loads the whole state ---------

    def state_dict(self) -> dict:
        """This rank's shard, and what it takes to read it without the model: the strategy, and
        each group's layout (`layout_record`) over the `world_size` ranks that step together."""
        return {
            "step_count": self.step_count,
            "world_size": self.world_size,
            "rank": self.rank,
            "groups": {g.name: {k: v.clone() for k, v in g.state.items()} for g in self.groups},
            "strategy": self.sync.name,
            "layouts": self.layouts(),
        }

    def layouts(self) -> dict[str, dict]:
        return {g.name: layout_record(g, self.world_size) for g in self.groups}

    def load_state_dict(self, sd: dict) -> None:
        """This rank's own shard (saved by the same rank of as many ranks), taken as it is; or a
        whole state (merge_optimizer_states), of which this rank takes its part in its own layout."""
        if sd.get("format") == WHOLE_FORMAT:
            self._load_whole(sd)
            return
        if sd["world_size"] != self.world_size or sd["rank"] != self.rank:
            raise ValueError(
                f"optimizer shard was saved by rank {sd['rank']} of {sd['world_size']}, this is rank "
                f"{self.rank} of {self.world_size}: load the whole state merged from every rank's shard "
                f"(merge_optimizer_states), or start a new run (another --run-name)")
        differ = groups_laid_out_differently(sd["layouts"], self.layouts()) if "layouts" in sd else []
        if differ:
            raise ValueError(f"optimizer shard's groups {differ} are laid out differently from this model's: "
                             f"not a checkpoint of this model's optimizer; start a new run (another --run-name)")
        self.step_count = sd["step_count"]
        for g in self.groups:  # checkpoints are read onto the CPU: the state goes to the parameters' device
            self.sync.load_state(g, sd["groups"][g.name])

    def _load_whole(self, sd: dict) -> None:
        """Check that the whole state fits every group of this model, then load each rank's part."""
        names = [g.name for g in self.groups]
        if set(sd["groups"]) != set(names):
            raise ValueError(f"whole optimizer state has groups {sorted(sd['groups'])}, this model's optimizer "
                             f"{sorted(names)}: not a checkpoint of this model; start a new run (another --run-name)")
        wholes = {}
        for g in self.groups:
            layout = FlatLayout.of(g, 1)
            want = {key: (layout.numel, *layout.item) for key in WHOLE_KEYS[g.kind]}
            got = {key: tuple(t.shape) for key, t in sd["groups"][g.name].items()}
            if got != want:
                raise ValueError(f"whole optimizer state of group {g.name} holds {got}, this model's needs {want}: "
                                 f"not a checkpoint of this model; start a new run (another --run-name)")
            wholes[g.name] = {k: t.to(g.params[0].dtype) for k, t in sd["groups"][g.name].items()}
        self.step_count = sd["step_count"]
        for g in self.groups:
            self.sync.load_state(g, self.sync.shard_of_whole(g, wholes[g.name]))


# ---- the optimizer state whatever the layout --------------------------------------------------------

WHOLE_FORMAT = "whole"  # a whole optimizer state's "format" (a rank's own shard has none)
STRATEGIES: dict[str, type[SyncStrategy]] = {s.name: s for s in (LocalSync, Zero2Sync, SharedMemorySync)}


def groups_laid_out_differently(a: dict[str, dict], b: dict[str, dict]) -> list[str]:
    """The groups whose recorded layouts (MuonAdamW.layouts) differ, or that only one side has."""
    return sorted(name for name in a.keys() | b.keys() if a.get(name) != b.get(name))


def merge_optimizer_states(saved: list[dict]) -> dict:
    """The whole optimizer state from the state_dict()s of every rank of one optimizer (the ranks it
    stepped over: the world, or with local steps one node's), saved[r] rank r's.

    Returns {"format": "whole", "step_count": int, "saved_by": {"strategy": str, "world_size": int},
    "groups": {group: {key: tensor}}}: per group Muon's "momentum" or AdamW's "exp_avg" and
    "exp_avg_sq", each (items, *item) without padding (sync_strategy.WHOLE_KEYS), on the CPU;
    only tensors, ints and strings (loads with weights_only=True). `MuonAdamW.load_state_dict`
    takes it at any world size and with any strategy. Raises ValueError, naming what differs, for
    shards that do not make one whole: missing or extra ranks, other step counts, strategies,
    groups or layouts, tensors of the wrong shape, shards saved without their layouts.
    """
    if not saved:
        raise ValueError("no optimizer shards to merge")
    if any("layouts" not in sd for sd in saved):
        raise ValueError("optimizer shards saved without their layouts (an older checkpoint) cannot be merged: "
                         "resume with the world that saved them, or start a new run (another --run-name)")
    ranks = [(sd["rank"], sd["world_size"]) for sd in saved]
    if ranks != [(r, len(saved)) for r in range(len(saved))]:
        raise ValueError(f"optimizer shards of (rank, world size) {ranks}: merging needs every rank 0..n-1 of one "
                         f"world of n, in rank order")
    first = saved[0]
    for key in ("step_count", "strategy"):
        if any(sd[key] != first[key] for sd in saved):
            raise ValueError(f"optimizer shards differ in {key} (by rank: {[sd[key] for sd in saved]}): "
                             f"not one optimizer's shards")
    for r, sd in enumerate(saved):
        differ = groups_laid_out_differently(sd["layouts"], first["layouts"])
        if differ:
            raise ValueError(f"optimizer shards of ranks 0 and {r} differ in the layouts of groups {differ}: "
                             f"not one optimizer's shards")
    if first["strategy"] not in STRATEGIES:
        raise ValueError(f"optimizer shards of an unknown strategy {first['strategy']!r}: not one of "
                         f"{list(STRATEGIES)}")
    strategy = STRATEGIES[first["strategy"]]
    groups = {}
    for name, layout in first["layouts"].items():
        missing = [r for r, sd in enumerate(saved) if name not in sd["groups"]]
        if missing:
            raise ValueError(f"optimizer shards of ranks {missing} lack group {name}")
        groups[name] = strategy.whole_of_shards(name, layout, [sd["groups"][name] for sd in saved])
    return {"format": WHOLE_FORMAT, "step_count": first["step_count"], "groups": groups,
            "saved_by": {"strategy": first["strategy"], "world_size": first["world_size"]}}


def build_optimizer(model, cfg, rank: int, world_size: int, muon_dtype: torch.dtype,
                    arena: SharedArena | None = None, group: torch.distributed.ProcessGroup | None = None,
                    ) -> MuonAdamW:
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
    return MuonAdamW([g for g in adamw if g.params] + muon, rank, world_size, muon_dtype,
                     WIRE_DTYPES[cfg.grad_comm_dtype], WIRE_DTYPES[cfg.param_comm_dtype], arena, group)
