"""The one-process sync strategy: nothing to communicate, the update runs on the parameters.

Dense gradients stay autograd's own tensors; the embedding tables get one private gradient
buffer each, that the backward adds its rows into (sparse_rows.py). The optimizer state is the
whole state: Muon's stacked "momentum", AdamW's moments per parameter ("exp_avg.i", "exp_avg_sq.i").
"""

from __future__ import annotations

import torch

from .grad_target import clear_gradients
from .sparse_rows import TouchedRows
from .sync_strategy import WHOLE_KEYS, FlatLayout, Group, Optimizer, SyncStrategy, checked_part


class LocalSync(SyncStrategy):
    name = "local"

    def __init__(self, opt: Optimizer):
        super().__init__(opt)
        self.tables: dict[str, TouchedRows] = {}
        for g in opt.groups:
            if g.sparse_rows:
                g.grad_views = [torch.zeros_like(p) for p in g.params]
                for p, grad in zip(g.params, g.grad_views, strict=True):
                    p.grad = grad
                self.tables[g.name] = TouchedRows(g.params, g.grad_views)

    def step(self) -> None:
        for g in self.opt.groups:
            if g.sparse_rows:
                self.tables[g.name].gather()
            params = [p.data for p in g.params]
            if g.kind == "adamw":
                grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in g.params]
                self.opt.adamw(g, params, grads, *g.adamw_state(params))
                continue
            grads = torch.stack([p.grad if p.grad is not None else torch.zeros_like(p) for p in g.params])
            mom = g.state.setdefault("momentum", torch.zeros_like(grads))
            self.opt.muon(g, params, grads, mom)

    def zero_grad(self) -> None:
        for g in self.opt.groups:
            if g.sparse_rows:
                self.tables[g.name].clear()
            else:
                clear_gradients(g.params)

    # ---- checkpointing: the one shard is the whole state, per parameter --------------------------

    @staticmethod
    def whole_of_shards(name: str, layout: dict, shards: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        (state,) = shards
        items = (layout["items"], *layout["item"])
        if layout["kind"] == "muon":
            momentum = checked_part(name, "momentum", state.get("momentum"), items, "the saved")
            return {"momentum": torch.zeros(items) if momentum is None else momentum.clone()}
        whole = {}
        for key in WHOLE_KEYS["adamw"]:
            parts = [checked_part(name, f"{key}.{i}", state.get(f"{key}.{i}"), tuple(shape), "the saved")
                     for i, shape in enumerate(layout["params"])]
            if all(p is None for p in parts):  # not stepped yet
                whole[key] = torch.zeros(items)
            elif any(p is None for p in parts):
                raise ValueError(f"optimizer state of group {name}: {key} is saved for some parameters only")
            else:  # each parameter's elements at its place in the flat layout
                whole[key] = torch.cat([p.reshape(-1) for p in parts]).view(items)
        return whole

    def shard_of_whole(self, g: Group, whole: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if g.kind == "muon":
            return {"momentum": whole["momentum"]}
        offsets, shard = FlatLayout.of(g, 1).offsets, {"exp_avg": torch.zeros(0)}  # adamw_state's marker
        for key, tensor in whole.items():
            flat = tensor.reshape(-1)
            for i, (p, offset) in enumerate(zip(g.params, offsets, strict=True)):
                shard[f"{key}.{i}"] = flat[offset: offset + p.numel()].view(p.shape)
        return shard
