"""The token loader: the shards of a data dir as (inputs, targets) batches for one rank.

Documents are tokenized as they are read and BOS-prefixed. Two packings, neither with padding:

- bestfit (the default, as nanochat's BOS-aligned best-fit loader): every row starts at a
  document's BOS. The loader holds a buffer of documents; each row takes the largest one that
  still fits whole, again and again, and when none fits it crops the shortest to the row's end
  (the rest of that document is not read). One giant document costs at most one row an epoch.
- stream: documents back to back, a row reading on from exactly the next token. Nothing is
  cropped, so a document many rows long is read whole, row after row (a corpus of a few long
  documents may want that; one outlier in a corpus of prose wrecks the model with it).

The loader's position is part of every checkpoint: a resumed run reads on from exactly where it
stood (best-fit's buffer included, as references to documents), and carry_over_position() moves
the positions of a whole world of ranks onto another world size without reading a row group
twice or skipping one in an epoch (the buffered documents dealt out to the new ranks).
"""

from __future__ import annotations

import contextlib
from bisect import bisect_left, bisect_right
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .data import read_texts, row_group_pairs

if TYPE_CHECKING:
    from collections.abc import Callable
    from contextlib import AbstractContextManager

    from .tokenizer import Tokenizer

PACKINGS = ("bestfit", "stream")
# Documents best-fit chooses among, as nanochat's loader: enough that most rows are filled by whole
# documents. A resume reads again the row groups its buffered documents came from: the latest
# row group or two, and one for each long document still waiting (up to a few hundred, each a
# parquet read; only the buffered documents are tokenized).
BUFFER_DOCS = 1000

# One row group of a carried-over epoch: [epoch, global pair index, doc_index, token_offset],
# the last two where reading starts in it (not 0, 0 for a row group an old rank had begun).
CarriedItem = list[int]
# One document in best-fit's buffer: [epoch, global pair index, doc_index].
DocRef = list[int]


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
    state = {"split": saved[0]["split"], "rank": rank, "world_size": world_size, "epoch": epoch, "pair_index": 0,
             "doc_index": doc_index, "token_offset": token_offset, "carried": mine, "resume_epoch": horizon + 1}
    packing = saved[0].get("packing", "stream")
    if packing == "bestfit":
        # documents read into the old ranks' buffers and not yet placed in a row are owed too
        buffered = sorted([int(v) for v in ref] for s in saved for ref in s.get("buffer", []))
        state |= {"packing": packing, "buffer": buffered[rank::world_size]}
    return state


def _check_world(saved: list[dict[str, Any]]) -> None:
    layouts = [(state.get("split"), state.get("rank"), state.get("world_size"), state.get("packing", "stream"))
               for state in saved]
    if not saved or layouts != [layouts[0][:1] + (k, len(saved)) + layouts[0][3:] for k in range(len(saved))]:
        raise ValueError(f"loader states to carry over must be those of ranks 0..W-1 of one world of W ranks, "
                         f"one split and packing, in rank order; got (split, rank, world_size, packing) {layouts}")


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


def packing_mismatch(state: dict[str, Any], packing: str) -> str | None:
    """Why a loader that packs with `packing` cannot go on from `state`, or None. A stream position at a
    document's start (every state written before best-fit packing existed is the stream's) goes on
    best-fit with an empty buffer; best-fit's buffer, or a document begun, cannot be taken over."""
    packed = state.get("packing", "stream")
    later = state.get("carried", [])[int(state.get("pair_index", 0)) + 1:]  # those read are behind it
    begun = [int(state.get("token_offset", 0))] + [int(item[3]) for item in later]
    if packed == packing or (packed == "stream" and not any(begun)):
        return None
    return (f"the loader's position was saved with --packing {packed}, this run packs with --packing {packing}: "
            f"resume with --packing {packed} (train.yml: -e packing={packed}), or start a new run")


class TokenLoader:
    """Packs BOS-prefixed documents into rows of seq_len+1 tokens; yields (inputs, targets).

    Row groups are shared out over one flat list of (shard, row group) pairs, rank r taking
    the pairs whose index % world_size == r, so any world size works. The position is the
    next unread token: (epoch, pair, document, token offset); with best-fit packing the
    offset is always 0 and the documents read but not yet placed in a row are the buffer. A
    loader built from state_dict() yields exactly the batches the original would have yielded
    next. Train repeats forever (epoch counts the passes); val stops after its last full batch.

    A state from carry_over_position() first reads its explicit list of row groups (self.carried,
    pair_index indexing it), then the normal share from its resume_epoch on.

    `placements` says what the last batch holds: per row, (DocRef, tokens taken, document length)
    for each document in it; a crop is an entry whose tokens taken are fewer than its length.

    `reading` wraps every read of a row group (given what is read): the trainer's watchdog bounds
    it, so a read that never returns (a dying disk, a hung network mount) ends the rank naming the
    file instead of leaving it, and every rank waiting for it, hung.
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
        packing: str = "bestfit",
        buffer_docs: int = BUFFER_DOCS,
        num_threads: int | None = None,
        reading: Callable[[str], AbstractContextManager] = lambda what: contextlib.nullcontext(),
    ) -> None:
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch_size and seq_len must be positive, got {batch_size}, {seq_len}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        if packing not in PACKINGS or buffer_docs < 1:
            raise ValueError(f"packing must be one of {PACKINGS} with buffer_docs >= 1, got {packing!r}, {buffer_docs}")
        self.data_dir = Path(data_dir)
        self.tokenizer = tokenizer
        self.split = split
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.rank = rank
        self.world_size = world_size
        self.packing = packing
        self.buffer_docs = buffer_docs
        self.num_threads = num_threads
        self.reading = reading
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
        self._docs: list[list[int]] = []
        self._docs_pair: tuple[str, int] | None = None  # the row group self._docs was tokenized from
        self._done = False
        # best-fit's buffer: (reference, first tokens, length) by arrival, and (length, arrival) kept
        # sorted for the choice
        self._buffer: dict[int, tuple[DocRef, list[int], int]] = {}
        self._by_length: list[tuple[int, int]] = []
        self._buffered: set[tuple[int, int]] = set()  # (global pair, document) of each buffered one
        self._arrivals = 0
        self.placements: list[list[tuple[DocRef, int, int]]] = []
        if state is not None:
            self._load_state(state)

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
        if self.packing == "bestfit":  # a state without "packing" is the stream's, as before best-fit
            state["packing"] = self.packing
            state["buffer"] = [list(self._buffer[arrival][0]) for arrival in sorted(self._buffer)]
        return state

    def position(self) -> dict[str, Any]:
        """Where the loader reads, for a message: the state without the buffer's references."""
        return {k: v for k, v in self.state_dict().items() if k != "buffer"}

    def _load_state(self, state: dict[str, Any]) -> None:
        mine = {"split": self.split, "rank": self.rank, "world_size": self.world_size}
        theirs = {k: state.get(k) for k in mine}
        if theirs != mine:
            raise ValueError(f"loader state is for {theirs}, this loader is {mine}: positions do not carry over "
                             "as they are; carry_over_position() turns every old rank's state into this rank's")
        mismatch = packing_mismatch(state, self.packing)
        if mismatch:
            raise ValueError(mismatch)
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
        self._restore_buffer([[int(v) for v in ref] for ref in state.get("buffer", [])])

    def _restore_buffer(self, refs: list[DocRef]) -> None:
        """The buffered documents, tokenized again from their row groups, in their saved order."""
        if any(not 0 <= ref[1] < len(self.all_pairs) for ref in refs):
            raise ValueError(f"the loader's buffer names row groups beyond the {len(self.all_pairs)} of the "
                             f"{self.split} split of {self.data_dir}: was the data re-prepared?")
        by_pair: dict[int, set[int]] = {}
        for ref in refs:
            by_pair.setdefault(ref[1], set()).add(ref[2])
        kept: dict[tuple[int, int], tuple[list[int], int]] = {}  # a row's worth and the length: no more held
        for pair, docs in sorted(by_pair.items()):
            wanted = sorted(docs)
            texts = self._read(self.all_pairs[pair])
            if wanted[-1] >= len(texts):
                raise ValueError(f"the loader's buffer names document {wanted[-1]} of {self.all_pairs[pair]}, which "
                                 f"holds {len(texts)}: was the data re-prepared?")
            encoded = self.tokenizer.encode_batch([texts[d] for d in wanted], self.num_threads)
            kept |= {(pair, d): ([self.tokenizer.bos_id, *ids[: self.seq_len]], len(ids) + 1)
                     for d, ids in zip(wanted, encoded, strict=True)}
        for ref in refs:
            self._buffer_add(ref, *kept[ref[1], ref[2]])

    # ---- the stream of documents ------------------------------------------------------------------

    def _read(self, pair: tuple[str, int]) -> list[str]:
        """The documents of one row group, read under `reading`'s watch."""
        with self.reading(f"reading {self.data_dir / pair[0]} (row group {pair[1]})"):
            return read_texts(self.data_dir, pair)

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

    def _global_pair(self) -> int:
        """The index in all_pairs of the row group at the position (after _current_pair())."""
        if self.carried is not None:
            return self.carried[self.pair_index][1]
        return self.rank + self.pair_index * self.world_size

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
                texts = self._read(pair)
                bos = self.tokenizer.bos_id
                self._docs = [[bos, *ids] for ids in self.tokenizer.encode_batch(texts, self.num_threads)]
                self._docs_pair = pair
            if self.doc_index < len(self._docs):
                return self._docs[self.doc_index]
            empty_pairs += 1 if not self._docs else 0
            if empty_pairs > most_empty:
                raise ValueError(f"every row group of rank {self.rank}'s {self.split} share is empty")
            self._next_pair()

    # ---- stream packing: the next n tokens, documents back to back ------------------------------

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

    # ---- best-fit packing: rows of whole documents, the last one cropped ------------------------

    def _buffer_add(self, ref: DocRef, doc: list[int], length: int, arrival: int | None = None) -> None:
        """Only a row's worth of a document is kept: no row takes more of it. The choice goes by its
        whole length, so a document too long for any row waits, as it would whole; and a buffer
        that fills with such documents over many epochs holds buffer_docs rows at most, not
        buffer_docs copies of a 1.5 MB file."""
        if arrival is None:
            arrival, self._arrivals = self._arrivals, self._arrivals + 1
        self._buffer[arrival] = (ref, doc[: self.seq_len + 1], length)
        self._buffered.add((ref[1], ref[2]))
        key = (length, arrival)
        self._by_length.insert(bisect_left(self._by_length, key), key)

    def _buffer_pop(self, index: int) -> tuple[int, DocRef, list[int], int]:
        _, arrival = self._by_length.pop(index)
        ref, doc, length = self._buffer.pop(arrival)
        self._buffered.discard((ref[1], ref[2]))
        return arrival, ref, doc, length

    def _fill(self) -> None:
        """Read documents into the buffer until it holds buffer_docs of them, the (val) split ends, or
        the next document is still buffered from an earlier epoch: a rank whose share is smaller than
        the buffer would otherwise hold two copies of a document (and put both in one row), and a
        document too long for any row would wait there once more every epoch. Stopping there lets the
        buffer run down until that copy is placed: one that never fits is cropped, a row an epoch."""
        while len(self._buffer) < self.buffer_docs:
            doc = self._current_doc()
            if doc is None:
                return
            pair = self._global_pair()
            if (pair, self.doc_index) in self._buffered:
                return
            self._buffer_add([self.epoch, pair, self.doc_index], doc, len(doc))
            self.doc_index += 1

    def _choose(self, room: int) -> int:
        """Where in _by_length the next document of a row with `room` tokens left is: the longest that
        fits whole (the first to arrive among equals); when none fits, the shortest, to be cropped."""
        fits = bisect_right(self._by_length, (room, self._arrivals)) - 1
        if fits < 0:
            return 0
        return bisect_left(self._by_length, (self._by_length[fits][0], -1))

    def _best_fit_rows(self) -> list[int] | None:
        """The next batch's rows, one after another (None: val is used up)."""
        row_len = self.seq_len + 1
        tokens: list[int] = []
        placements: list[list[tuple[DocRef, int, int]]] = []
        taken: list[tuple[int, DocRef, list[int], int]] = []
        for _ in range(self.batch_size):
            row_end = len(tokens) + row_len
            placements.append([])
            while len(tokens) < row_end:
                self._fill()
                if not self._buffer:  # val is used up: the last partial batch's documents stay unread
                    for arrival, ref, doc, length in taken:
                        self._buffer_add(ref, doc, length, arrival)
                    return None
                arrival, ref, doc, length = self._buffer_pop(self._choose(row_end - len(tokens)))
                taken.append((arrival, ref, doc, length))
                piece = doc[: row_end - len(tokens)]
                tokens.extend(piece)
                placements[-1].append((ref, len(piece), length))
        self.placements = placements
        return tokens

    def __iter__(self) -> TokenLoader:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._done:
            raise StopIteration
        if self.packing == "bestfit":
            tokens = self._best_fit_rows()
        else:
            tokens = self._take(self.batch_size * (self.seq_len + 1))
        if tokens is None:  # val: a last partial batch is dropped
            self._done = True
            raise StopIteration
        rows = torch.tensor(tokens, dtype=torch.long).view(self.batch_size, self.seq_len + 1)
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


# ---- what packing costs a corpus -----------------------------------------------------------------

def cropping_cost(loader: TokenLoader, batches: int, warmup: int = 0) -> dict[str, float]:
    """Over `batches` batches after `warmup` more: the share of the documents' tokens placed in rows
    that cropping left unread, the share of the rows' tokens that come from whole documents, and
    the tokens of the documents still waiting in the buffer. The buffer starts as a fresh sample of
    the corpus and fills with documents too long to fit: the first batches crop less than a long
    run does, so measure after a warm-up."""
    for _ in zip(range(warmup), loader, strict=False):
        pass
    rows = taken = cropped = whole = 0
    for _ in zip(range(batches), loader, strict=False):
        for row in loader.placements:
            rows += 1
            for _, placed, length in row:
                taken += length
                cropped += length - placed
                whole += placed if placed == length else 0
    row_tokens = rows * (loader.seq_len + 1)
    waiting = sum(length for _, _, length in loader._buffer.values())
    return {"batches": rows / loader.batch_size if rows else 0, "row_tokens": row_tokens,
            "cropped_share": cropped / max(taken, 1), "whole_share": whole / max(row_tokens, 1),
            "waiting_tokens": waiting}


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json

    from .tokenizer import Tokenizer

    parser = argparse.ArgumentParser(prog="python -m nanochat_cpu.dataloader",
                                     description="What best-fit packing crops of a corpus at a row length.")
    parser.add_argument("--data-dir", required=True, type=Path)
    parser.add_argument("--tokenizer-dir", required=True, type=Path)
    parser.add_argument("--seq-len", type=int, default=512, help="the run's --max-seq-len")
    parser.add_argument("--rows", type=int, default=24, help="rows per batch")
    parser.add_argument("--batches", type=int, default=200, help="batches measured")
    parser.add_argument("--warmup", type=int, default=300, help="batches read first (a long run's buffer)")
    parser.add_argument("--buffer-docs", type=int, default=BUFFER_DOCS)
    args = parser.parse_args(argv)
    loader = TokenLoader(args.data_dir, Tokenizer.load(args.tokenizer_dir), "train", args.rows, args.seq_len,
                         buffer_docs=args.buffer_docs)
    cost = cropping_cost(loader, args.batches, args.warmup)
    print(f"{args.data_dir}, rows of {args.seq_len + 1} tokens, after {args.warmup} batches: over "
          f"{cost['row_tokens']:,} row tokens, cropping "
          f"left {100 * cost['cropped_share']:.1f}% of the documents' tokens unread; "
          f"{100 * cost['whole_share']:.1f}% of the rows' tokens are whole documents; "
          f"{cost['waiting_tokens']:,} tokens wait in the buffer")
    print(json.dumps({"seq_len": args.seq_len, "warmup": args.warmup, **cost}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
