"""The token loader: the shards of a data dir as (inputs, targets) batches for one rank.

Documents are tokenized as they are read, BOS-prefixed and packed back to back into rows, so no
token is padding. The loader's position is part of every checkpoint: a resumed run reads on
from exactly the next token, and carry_over_position() moves the positions of a whole world of
ranks onto another world size without reading a row group twice or skipping one in an epoch.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .data import read_texts, row_group_pairs

if TYPE_CHECKING:
    from .tokenizer import Tokenizer

# One row group of a carried-over epoch: [epoch, global pair index, doc_index, token_offset],
# the last two where reading starts in it (not 0, 0 for a row group an old rank had begun).
CarriedItem = list[int]


def carry_over_position(saved: list[dict[str, Any]], rank: int, world_size: int, num_pairs: int) -> dict[str, Any]:
    """The loader state new rank `rank` of `world_size` loads, from the states of every old rank.

    saved[k] is exactly what old rank k's state_dict() returned, for k in 0..W-1; num_pairs is
    len(row_group_pairs(data_dir, split)). With W == world_size the rank's own state comes back
    untouched (an exact resume). Otherwise the old world's remaining work is dealt anew:

    - Each old rank's remaining work is its schedule from its position on: the rest of its
      list or epoch (the row group it stands in begun at its saved doc_index/token_offset),
      then whole shares of the later epochs. Epochs count up to the horizon: the latest epoch
      an old rank stands in or holds carried-over row groups of (ranks with uneven batches drift
      apart, even by several epochs). Nobody has read anything past it.
    - In every epoch up to the horizon, the row groups still to read are exactly the union of
      the old ranks' remaining ones: every deal gives each row group of an epoch to one rank, so
      the ones missing from the union were read, and the ones in it were not (or only up to the
      saved offset). Ranks ahead have nothing left in the epochs behind them; ranks behind owe
      their whole shares of the epochs in between.
    - That work, ordered by epoch, then begun row groups first, then by pair index, is dealt
      round-robin: new ranks get counts within one of each other, and a begun row group goes to
      exactly one new rank, which continues it from the saved doc_index/token_offset.

    The result is a state like state_dict()'s, plus "carried" (the rank's list of CarriedItem,
    read from "pair_index" on) and "resume_epoch" (the epoch after the horizon: after its list
    the rank goes on with normal epochs, all_pairs[rank::world_size], from there). It is plain
    ints and lists, as checkpoints loaded with torch.load(weights_only=True) need.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    _check_world(saved)
    old_world = len(saved)
    if old_world == world_size:
        return saved[rank]
    horizon = max(_last_uneven_epoch(state) for state in saved)
    todo = [item for old_rank, state in enumerate(saved)
            for item in _remaining(state, list(range(old_rank, num_pairs, old_world)), horizon, num_pairs)]
    todo.sort(key=lambda item: (item[0], item[2:] == [0, 0], item[1]))
    mine = todo[rank::world_size]
    # an empty list is a rank at the end of the horizon epoch: its next read starts the normal deal
    epoch, _, doc_index, token_offset = mine[0] if mine else [horizon, 0, 0, 0]
    return {"split": saved[0]["split"], "rank": rank, "world_size": world_size, "epoch": epoch, "pair_index": 0,
            "doc_index": doc_index, "token_offset": token_offset, "carried": mine, "resume_epoch": horizon + 1}


def _check_world(saved: list[dict[str, Any]]) -> None:
    layouts = [(state.get("split"), state.get("rank"), state.get("world_size")) for state in saved]
    if not saved or layouts != [(saved[0].get("split"), k, len(saved)) for k in range(len(saved))]:
        raise ValueError(f"loader states to carry over must be those of ranks 0..W-1 of one world of W ranks, "
                         f"one split, in rank order; got (split, rank, world_size) {layouts}")


def _last_uneven_epoch(state: dict[str, Any]) -> int:
    """The last epoch in which this rank's remaining work is not simply its whole share."""
    return int(state["resume_epoch"]) - 1 if "carried" in state else int(state["epoch"])


def _remaining(state: dict[str, Any], share: list[int], horizon: int, num_pairs: int) -> list[CarriedItem]:
    """What one old rank has still to read in the epochs up to horizon, from its position on."""
    pair_index = int(state["pair_index"])
    if "carried" in state:
        schedule = [[int(v) for v in item] for item in state["carried"]]
        first_whole_epoch = int(state["resume_epoch"])
    else:
        schedule = [[int(state["epoch"]), g, 0, 0] for g in share]
        first_whole_epoch = int(state["epoch"]) + 1
    if not 0 <= pair_index <= len(schedule) or any(not 0 <= item[1] < num_pairs for item in schedule):
        raise ValueError(f"loader state {state} does not fit a split of {num_pairs} row groups: "
                         "was the data re-prepared?")
    rest = schedule[pair_index:]
    if rest:
        rest[0][2:] = [int(state["doc_index"]), int(state["token_offset"])]
    return rest + [[epoch, g, 0, 0] for epoch in range(first_whole_epoch, horizon + 1) for g in share]


class TokenLoader:
    """Packs BOS-prefixed documents into rows of seq_len+1 tokens; yields (inputs, targets).

    Row groups are shared out over one flat list of (shard, row group) pairs, rank r taking
    the pairs whose index % world_size == r, so any world size works. The position is the
    next unread token: (epoch, pair, document, token offset). A loader built from
    state_dict() yields exactly the batches the original would have yielded next.
    Train repeats forever (epoch counts the passes); val stops after its last full batch.

    A state from carry_over_position() first reads its explicit list of row groups (self.carried,
    pair_index indexing it), then the normal share from its resume_epoch on.
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
        self.all_pairs = row_group_pairs(self.data_dir, split)
        self.pairs = self.all_pairs[rank::world_size]
        if not self.pairs:
            raise ValueError(
                f"{split} split of {self.data_dir} has {len(self.all_pairs)} row groups, too few for rank {rank} "
                f"of world_size {world_size}: re-prepare it with a smaller --rows-per-group"
            )
        self.epoch = self.pair_index = self.doc_index = self.token_offset = 0
        self.carried: list[CarriedItem] | None = None  # row groups of a carried-over epoch, then the share
        self.resume_epoch = 0
        if state is not None:
            self._load_state(state)
        self._docs: list[list[int]] = []
        self._docs_pair: tuple[str, int] | None = None  # the row group self._docs was tokenized from
        self._done = False

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "split": self.split,
            "rank": self.rank,
            "world_size": self.world_size,
            "epoch": self.epoch,
            "pair_index": self.pair_index,
            "doc_index": self.doc_index,
            "token_offset": self.token_offset,
        }
        if self.carried is not None:
            state["carried"] = [list(item) for item in self.carried]
            state["resume_epoch"] = self.resume_epoch
        return state

    def _load_state(self, state: dict[str, Any]) -> None:
        mine = {"split": self.split, "rank": self.rank, "world_size": self.world_size}
        theirs = {k: state.get(k) for k in mine}
        if theirs != mine:
            raise ValueError(f"loader state is for {theirs}, this loader is {mine}: positions do not carry over "
                             "as they are; carry_over_position() turns every old rank's state into this rank's")
        self.epoch = int(state["epoch"])
        self.pair_index = int(state["pair_index"])
        self.doc_index = int(state["doc_index"])
        self.token_offset = int(state["token_offset"])
        if "carried" in state:
            self.carried = [[int(v) for v in item] for item in state["carried"]]
            self.resume_epoch = int(state["resume_epoch"])
            if any(not 0 <= item[1] < len(self.all_pairs) for item in self.carried):
                raise ValueError(f"carried-over loader state names row groups beyond the {len(self.all_pairs)} "
                                 f"of the {self.split} split of {self.data_dir}: was the data re-prepared?")

    def _current_pair(self) -> tuple[str, int] | None:
        """The row group at the position, moving on into the next epoch past the end of a list;
        None when the val split is used up."""
        if self.carried is not None:
            if self.pair_index < len(self.carried):
                return self.all_pairs[self.carried[self.pair_index][1]]
            if self.split == "val":
                return None
            self.carried = None  # the carried-over epochs are read: normal epochs from here on
            self.epoch, self.pair_index, self.doc_index, self.token_offset = self.resume_epoch, 0, 0, 0
        if self.pair_index >= len(self.pairs):
            if self.split == "val":
                return None
            self.epoch += 1
            self.pair_index = self.doc_index = self.token_offset = 0
        return self.pairs[self.pair_index]

    def _next_pair(self) -> None:
        self.pair_index += 1
        self.doc_index = self.token_offset = 0
        if self.carried is not None and self.pair_index < len(self.carried):
            # a row group an old rank had begun starts where that rank stopped
            self.epoch, _, self.doc_index, self.token_offset = self.carried[self.pair_index]

    def _current_doc(self) -> list[int] | None:
        """Tokens of the document at the position, moving on past ended row groups and epochs;
        None when the val split is used up."""
        empty_pairs = 0
        most_empty = len(self.pairs) + len(self.carried or [])
        while True:
            pair = self._current_pair()
            if pair is None:
                return None
            if self._docs_pair != pair:
                texts = read_texts(self.data_dir, pair)
                bos = self.tokenizer.bos_id
                self._docs = [[bos, *ids] for ids in self.tokenizer.encode_batch(texts, self.num_threads)]
                self._docs_pair = pair
            if self.doc_index < len(self._docs):
                return self._docs[self.doc_index]
            empty_pairs += 1 if not self._docs else 0
            if empty_pairs > most_empty:
                raise ValueError(f"every row group of rank {self.rank}'s {self.split} share is empty")
            self._next_pair()

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

