"""The one-process sync strategy: nothing to communicate, the update runs on the parameters.

Dense gradients stay autograd's own tensors; the embedding tables get one private gradient
buffer each, that the backward adds its rows into (sparse_rows.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .grad_target import clear_gradients
from .sparse_rows import TouchedRows
from .sync_strategy import SyncStrategy

if TYPE_CHECKING:
    from .optim import MuonAdamW


class LocalSync(SyncStrategy):
    def __init__(self, opt: MuonAdamW):
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
