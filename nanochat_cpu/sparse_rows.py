"""The rows of the embedding tables that got gradients since the last step.

The token and value embedding tables get gradients only in the rows of tokens the rank saw (the
model asks for sparse gradients). Each table keeps one dense gradient buffer that the backward
adds its rows into, and after a step only the rows that got some are zeroed again: nothing of the
size of a table is zeroed, allocated or added up per step. The sync strategies also use the row
ids to move only those rows between ranks.
"""

from __future__ import annotations

import torch

from .sync_strategy import grad_into


class TouchedRows:
    """Per table of one group, the row ids its gradient received since the last clear(); None
    once a dense gradient arrived (a compiled model's embedding backward is dense): any row may
    then be non-zero. The ids outlive a trainer's .grad = None: the buffer keeps the rows."""

    def __init__(self, params: list[torch.Tensor], grads: list[torch.Tensor]):
        self.params, self.grads = params, grads  # the tables and their gradient buffers
        self.rows: list[list[torch.Tensor] | None] = [[] for _ in params]
        for i, p in enumerate(params):
            p.register_hook(self._hook(i))

    def _hook(self, i: int):
        def hook(grad: torch.Tensor) -> None:
            if not grad.is_sparse:
                self.rows[i] = None
            elif self.rows[i] is not None:
                self.rows[i].append(grad._indices()[0])
        return hook

    def gather(self) -> None:
        """Make every table's .grad its buffer again, with its gradient in it (grad_into)."""
        for i, (p, grad) in enumerate(zip(self.params, self.grads, strict=True)):
            if grad_into(p, grad):  # a dense gradient: any row may be non-zero
                self.rows[i] = None

    def dirty(self) -> torch.Tensor | None:
        """The rows (of the group's tables stacked) whose gradient may be non-zero; None: any."""
        ids, offset = [], 0
        for p, rows in zip(self.params, self.rows, strict=True):
            if rows is None:
                return None
            ids += [r + offset for r in rows]
            offset += p.shape[0]
        return torch.cat(ids).unique() if ids else torch.zeros(0, dtype=torch.int64, device=self.params[0].device)

    def clear(self) -> None:
        """Zero the rows the buffers got since the last clear, and make them the .grad again."""
        for i, (p, grad) in enumerate(zip(self.params, self.grads, strict=True)):
            if self.rows[i] is None:
                grad.zero_()
            else:
                for rows in self.rows[i]:
                    grad.index_fill_(0, rows, 0)
            p.grad = grad
            self.rows[i] = []
