"""The token loader: the shards of a data dir as (inputs, targets) batches for one rank.

Documents are tokenized as they are read, BOS-prefixed and packed back to back into rows, so no
token is padding. The loader's position is part of every checkpoint: a resumed run reads on
from exactly the next token.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .data import read_texts, row_group_pairs

if TYPE_CHECKING:
    from .tokenizer import Tokenizer


class TokenLoader:
    """Packs BOS-prefixed documents into rows of seq_len+1 tokens; yields (inputs, targets).

    Row groups are shared out over one flat list of (shard, row group) pairs, rank r taking
    the pairs whose index % world_size == r, so any world size works. The position is the
    next unread token: (epoch, pair, document, token offset). A loader built from
    state_dict() yields exactly the batches the original would have yielded next.
    Train repeats forever (epoch counts the passes); val stops after its last full batch.
    """

    def __init__(
        self,
        data_dir: str | Path,
        tokenizer: Tokenizer,
        split: str,
        batch_size: int,
        seq_len: int,
        rank: int = 0,
        world_size: int = 1,
        state: dict[str, Any] | None = None,
        *,
        num_threads: int | None = None,
    ) -> None:
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch_size and seq_len must be positive, got {batch_size}, {seq_len}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        self.data_dir = Path(data_dir)
        self.tokenizer = tokenizer
        self.split = split
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.rank = rank
        self.world_size = world_size
        self.num_threads = num_threads
        all_pairs = row_group_pairs(self.data_dir, split)
        self.pairs = all_pairs[rank::world_size]
        if not self.pairs:
            raise ValueError(
                f"{split} split of {self.data_dir} has {len(all_pairs)} row groups, too few for rank {rank} "
                f"of world_size {world_size}: re-prepare it with a smaller --rows-per-group"
            )
        self.epoch = self.pair_index = self.doc_index = self.token_offset = 0
        if state is not None:
            self._load_state(state)
        self._docs: list[list[int]] = []
        self._docs_pair = -1  # pair index self._docs was tokenized from
        self._done = False

    def state_dict(self) -> dict[str, Any]:
        return {
            "split": self.split,
            "rank": self.rank,
            "world_size": self.world_size,
            "epoch": self.epoch,
            "pair_index": self.pair_index,
            "doc_index": self.doc_index,
            "token_offset": self.token_offset,
        }

    def _load_state(self, state: dict[str, Any]) -> None:
        mine = {"split": self.split, "rank": self.rank, "world_size": self.world_size}
        theirs = {k: state.get(k) for k in mine}
        if theirs != mine:
            raise ValueError(f"loader state is for {theirs}, this loader is {mine}: positions do not carry over")
        self.epoch = int(state["epoch"])
        self.pair_index = int(state["pair_index"])
        self.doc_index = int(state["doc_index"])
        self.token_offset = int(state["token_offset"])

    def _current_doc(self) -> list[int] | None:
        """Tokens of the document at the position, moving on past ended row groups and epochs;
        None when the val split is used up."""
        empty_pairs = 0
        while True:
            if self.pair_index >= len(self.pairs):
                if self.split == "val":
                    return None
                self.epoch += 1
                self.pair_index = self.doc_index = self.token_offset = 0
            if self._docs_pair != self.pair_index:
                texts = read_texts(self.data_dir, self.pairs[self.pair_index])
                bos = self.tokenizer.bos_id
                self._docs = [[bos, *ids] for ids in self.tokenizer.encode_batch(texts, self.num_threads)]
                self._docs_pair = self.pair_index
            if self.doc_index < len(self._docs):
                return self._docs[self.doc_index]
            empty_pairs += 1 if not self._docs else 0
            if empty_pairs > len(self.pairs):
                raise ValueError(f"every row group of rank {self.rank}'s {self.split} share is empty")
            self.pair_index += 1
            self.doc_index = self.token_offset = 0

    def _take(self, n: int) -> list[int] | None:
        out: list[int] = []
        while len(out) < n:
            doc = self._current_doc()
            if doc is None:
                return None
            piece = doc[self.token_offset : self.token_offset + n - len(out)]
            out.extend(piece)
            self.token_offset += len(piece)
            if self.token_offset >= len(doc):
                self.doc_index += 1
                self.token_offset = 0
        return out

    def __iter__(self) -> TokenLoader:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._done:
            raise StopIteration
        tokens = self._take(self.batch_size * (self.seq_len + 1))
        if tokens is None:  # val: a last partial batch is dropped
            self._done = True
            raise StopIteration
        rows = torch.tensor(tokens, dtype=torch.long).view(self.batch_size, self.seq_len + 1)
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

