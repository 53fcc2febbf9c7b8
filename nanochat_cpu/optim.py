"""Muon for the block matrices, AdamW for everything else; one class for 1 and N ranks.

With N ranks the optimizer also does the gradient synchronisation, ZeRO-2 style:

1. reduce-scatter: each rank receives the summed gradient of only the slice it owns,
2. it updates that slice with its own (sharded) optimizer state,
3. all-gather: every rank receives every updated slice.

Ownership, per group:
- AdamW groups are flattened into one buffer, padded to a multiple of the world size, and cut
  into equal contiguous slices: any world size works (no divisibility of the vocabulary).
- Muon groups hold matrices of one shape, stacked and padded with zero matrices to a
  multiple of the world size; each rank orthogonalises whole matrices (Newton-Schulz needs the
  whole matrix), so the orthogonalisation cost is split across ranks too.

Collectives are started asynchronously and completed with `Work.wait()`, never
`Work.get_future()`, which Gloo does not implement for reduce-scatter. All reduce-scatters
are launched before any update is computed, so later groups' communication overlaps earlier
groups' arithmetic.

Gradients are *summed* across ranks: the trainer scales each rank's loss by its share of the
global batch's tokens, so uneven per-rank batches still give the global mean gradient.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# Quintic Newton-Schulz coefficients (Keller Jordan, modded-nanogpt): maximise the slope at
# zero so 5 iterations push all singular values into roughly [0.7, 1.2].
NS_COEFFS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5

# torch 2.13 renamed the tensor collectives (the old names warn); older torch has only the old ones
reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
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
    lr_multiplier: float = 1.0  # set by the schedule each step
    # sharding bookkeeping, filled in by the optimizer
    numel: int = 0
    shard: int = 0
    state: dict[str, torch.Tensor] = field(default_factory=dict)


class MuonAdamW:
    def __init__(self, groups: list[Group], rank: int = 0, world_size: int = 1,
                 muon_dtype: torch.dtype = torch.float32, comm_dtype: torch.dtype = torch.float32):
        self.groups = groups
        self.rank, self.world_size = rank, world_size
        self.muon_dtype = muon_dtype
        # Gradients may travel in bf16 (half the bytes on a slow link); parameters always travel
        # in fp32, so every rank holds bit-identical weights.
        self.comm_dtype = comm_dtype
        self.step_count = 0
        self.last_comm_wait = 0.0  # seconds the last step spent blocked on communication
        for g in groups:
            if g.kind == "muon":
                shapes = {tuple(p.shape) for p in g.params}
                assert len(shapes) == 1, f"muon group {g.name} mixes shapes {shapes}"
                g.numel = len(g.params)  # number of matrices
            else:
                g.numel = sum(p.numel() for p in g.params)
            g.shard = -(-g.numel // world_size)  # ceil: slices of equal size, last one padded

    # ---- communication helpers -------------------------------------------------------------

    def _flat_grads(self, g: Group) -> torch.Tensor:
        """All gradients of a group in one padded buffer (matrices stacked for Muon)."""
        p0 = g.params[0]
        if g.kind == "muon":
            buf = torch.zeros((g.shard * self.world_size, *p0.shape), dtype=p0.dtype, device=p0.device)
            for i, p in enumerate(g.params):
                if p.grad is not None:
                    buf[i].copy_(p.grad)
            return buf
        buf = torch.zeros(g.shard * self.world_size, dtype=p0.dtype, device=p0.device)
        offset = 0
        for p in g.params:
            n = p.numel()
            if p.grad is not None:
                buf[offset: offset + n].copy_(p.grad.reshape(-1))
            offset += n
        return buf

    def _my_param_slice(self, g: Group) -> torch.Tensor:
        """A copy of the parameter values this rank owns, in the padded flat layout."""
        p0 = g.params[0]
        lo, hi = self.rank * g.shard, (self.rank + 1) * g.shard
        if g.kind == "muon":
            out = torch.zeros((g.shard, *p0.shape), dtype=p0.dtype, device=p0.device)
            for i in range(lo, min(hi, g.numel)):
                out[i - lo].copy_(g.params[i].data)
            return out
        out = torch.zeros(g.shard, dtype=p0.dtype, device=p0.device)
        offset = 0
        for p in g.params:
            n = p.numel()
            a, b = max(lo, offset), min(hi, offset + n)
            if a < b:
                out[a - lo: b - lo].copy_(p.data.reshape(-1)[a - offset: b - offset])
            offset += n
        return out

    def _scatter_back(self, g: Group, full: torch.Tensor) -> None:
        if g.kind == "muon":
            for i, p in enumerate(g.params):
                p.data.copy_(full[i])
            return
        offset = 0
        for p in g.params:
            p.data.copy_(full[offset: offset + p.numel()].view_as(p))
            offset += p.numel()

    # ---- updates on the owned slice ----------------------------------------------------------

    def _adamw(self, g: Group, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        """AdamW on a list of tensors (one flat slice with N ranks, the parameters with 1)."""
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
        steps = [torch.tensor(float(self.step_count)) for _ in params]
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

    def _owned_matrices(self, g: Group) -> int:
        return max(0, min(g.shard, g.numel - self.rank * g.shard))

    # ---- the step ----------------------------------------------------------------------------

    @torch.no_grad()
    def step(self) -> None:
        self.step_count += 1
        if self.world_size == 1:
            for g in self.groups:
                if g.kind == "adamw":
                    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in g.params]
                    self._adamw(g, [p.data for p in g.params], grads)
                    continue
                grads = torch.stack([p.grad if p.grad is not None else torch.zeros_like(p) for p in g.params])
                self._muon(g, [p.data for p in g.params], grads, len(g.params))
            return
        pending = []
        for g in self.groups:
            grads = self._flat_grads(g).to(self.comm_dtype)
            out = torch.empty_like(grads[: g.shard])
            work = reduce_scatter(out, grads, op=dist.ReduceOp.SUM, async_op=True)
            pending.append((g, out, work))
        gathers = []
        waited = 0.0
        for g, grad_slice, work in pending:
            t0 = time.perf_counter()
            work.wait()
            waited += time.perf_counter() - t0
            mine = self._my_param_slice(g)
            self._update_slice(g, mine, grad_slice.to(mine.dtype))
            gathered = torch.empty((g.shard * self.world_size, *mine.shape[1:]), dtype=mine.dtype,
                                   device=mine.device)
            gathers.append((g, gathered, all_gather(gathered, mine, async_op=True)))
        for g, gathered, work in gathers:
            t0 = time.perf_counter()
            work.wait()
            waited += time.perf_counter() - t0
            self._scatter_back(g, gathered)
        self.last_comm_wait = waited

    def _update_slice(self, g: Group, params: torch.Tensor, grads: torch.Tensor) -> None:
        if g.kind == "muon":
            self._muon(g, params, grads, self._owned_matrices(g))
        else:
            self._adamw(g, [params], [grads])

    def zero_grad(self) -> None:
        for g in self.groups:
            for p in g.params:
                p.grad = None

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
        for g in self.groups:
            g.state = {k: v.clone() for k, v in sd["groups"][g.name].items()}


def build_optimizer(model, cfg, rank: int, world_size: int, muon_dtype: torch.dtype,
                    comm_dtype: torch.dtype = torch.float32) -> MuonAdamW:
    from .model import parameter_groups

    groups = parameter_groups(model)
    # AdamW LRs were tuned at width 768; scale them like 1/sqrt(width) (nanochat's rule)
    scale = (model.cfg.n_embd / 768) ** -0.5
    adamw = [
        Group("adamw", "lm_head", groups["lm_head"], lr=cfg.unembedding_lr * scale),
        Group("adamw", "embedding", groups["embedding"], lr=cfg.embedding_lr * scale),
        Group("adamw", "value_embedding", groups["value_embedding"], lr=cfg.embedding_lr * scale),
        Group("adamw", "scalar", groups["scalar"], lr=cfg.scalar_lr * 0.01),
    ]
    by_shape: dict[tuple[int, ...], list[torch.nn.Parameter]] = {}
    for p in groups["matrix"]:
        by_shape.setdefault(tuple(p.shape), []).append(p)
    muon = [Group("muon", f"matrix_{'x'.join(map(str, shape))}", ps, lr=cfg.matrix_lr,
                  weight_decay=cfg.weight_decay) for shape, ps in sorted(by_shape.items())]
    return MuonAdamW([g for g in adamw if g.params] + muon, rank, world_size, muon_dtype, comm_dtype)
