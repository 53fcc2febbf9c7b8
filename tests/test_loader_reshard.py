"""The token loader's position carried over to another world size: every row group once per epoch.

Each token a loader reads is labelled (epoch, pair, doc, token index). Labels are derived here
from the parquet shards and the state's lists alone, and every batch is checked against the
token ids they name, so the coverage checks below are about what the loaders really read.
"""

from __future__ import annotations

import functools
import itertools
import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import torch
from test_data import all_pairs, as_rows, take

from nanochat_cpu.dataloader import TokenLoader, carry_over_position
from nanochat_cpu.tokenizer import Tokenizer

# The stream packing's position (best-fit's buffer on top of it: test_bestfit_loader.py).
StreamLoader = functools.partial(TokenLoader, packing="stream")
Label = tuple[int, int, int, int]  # epoch, global pair index, document, token index
SEQ_LEN = 32


@pytest.fixture(scope="module")
def tok(tiny_tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer.load(tiny_tokenizer_dir)


def split_docs(data_dir: Path, tok: Tokenizer, split: str) -> list[list[list[int]]]:
    """Every row group's BOS-prefixed documents, by global pair index."""
    groups = []
    for name, group in all_pairs(data_dir, split):
        texts = pq.ParquetFile(data_dir / name).read_row_group(group).column("text").to_pylist()
        groups.append([[tok.bos_id, *tok.encode(text)] for text in texts])
    return groups


@pytest.fixture(scope="module")
def docs(tiny_data_dir: Path, tok: Tokenizer) -> list[list[list[int]]]:
    return split_docs(tiny_data_dir, tok, "train")


def labelled(epoch: int, pair: int, doc: int, offset: int, docs: list[list[list[int]]]) -> Iterator[Label]:
    """The tokens of one row group from (doc, offset) on."""
    for d in range(doc, len(docs[pair])):
        yield from ((epoch, pair, d, t) for t in range(offset if d == doc else 0, len(docs[pair][d])))


def schedule(state: dict[str, Any], docs: list[list[list[int]]]) -> Iterator[Label]:
    """What a loader built from `state` reads, for a state at the start of its list or its epoch."""
    assert state["pair_index"] == 0
    for epoch, pair, doc, offset in state.get("carried", []):
        yield from labelled(epoch, pair, doc, offset, docs)
    start = (state["doc_index"], state["token_offset"]) if "carried" not in state else (0, 0)
    for epoch in itertools.count(state.get("resume_epoch", state["epoch"])):
        for pair in range(state["rank"], len(docs), state["world_size"]):
            yield from labelled(epoch, pair, *start, docs)
            start = (0, 0)


class World:
    """The loaders of every rank of one world, each beside the labels it reads next."""

    def __init__(self, data_dir: Path, tok: Tokenizer, docs: list[list[list[int]]], states: list[dict[str, Any]],
                 batch_sizes: list[int]) -> None:
        self.docs = docs
        self.loaders = [StreamLoader(data_dir, tok, "train", b, SEQ_LEN, s["rank"], s["world_size"], state=s)
                        for s, b in zip(states, batch_sizes, strict=True)]
        self.ahead = [schedule(s, docs) for s in states]

    def read(self, rank: int, batches: int) -> list[Label]:
        """Take batches from one rank; check them token for token against its labels."""
        got = torch.cat([as_rows(b).flatten() for b in take(self.loaders[rank], batches)]).tolist()
        labels = list(itertools.islice(self.ahead[rank], len(got)))
        assert got == [self.docs[p][d][t] for _, p, d, t in labels]
        return labels

    def states(self) -> list[dict[str, Any]]:
        return [json.loads(json.dumps(loader.state_dict())) for loader in self.loaders]  # as a checkpoint keeps it


def fresh(world_size: int) -> list[dict[str, Any]]:
    """States of a world that has read nothing, in today's format."""
    return [{"split": "train", "rank": r, "world_size": world_size, "epoch": 0, "pair_index": 0, "doc_index": 0,
             "token_offset": 0} for r in range(world_size)]


def tokens_from(pair: int, doc: int, offset: int, docs: list[list[list[int]]]) -> list[int]:
    return [t for d in docs[pair][doc:] for t in d][offset:]


def carried_tokens(state: dict[str, Any], docs: list[list[list[int]]]) -> int:
    return sum(1 for item in state["carried"] for _ in labelled(*item, docs))


def carry(states: list[dict[str, Any]], world_size: int, num_pairs: int) -> list[dict[str, Any]]:
    return [carry_over_position(states, r, world_size, num_pairs) for r in range(world_size)]


def batches_to_read(loader: TokenLoader, tokens: int) -> int:
    return -(-tokens // (loader.batch_size * (SEQ_LEN + 1)))


def read_rest_of_carried_epochs(world: World, states: list[dict[str, Any]]) -> list[Label]:
    """Every new rank reads its carried list to the end, and a little of the normal epoch after."""
    labels: list[Label] = []
    for rank, (loader, state) in enumerate(zip(world.loaders, states, strict=True)):
        carried = carried_tokens(state, world.docs)
        read = world.read(rank, batches_to_read(loader, carried) + 1)
        assert all(label[0] == state["resume_epoch"] for label in read[carried:])
        labels += read[:carried]
    return labels


def assert_each_token_once(labels: list[Label], docs: list[list[list[int]]], epochs: int) -> None:
    counts = Counter(labels)
    every = Counter(label for e in range(epochs) for p in range(len(docs)) for label in labelled(e, p, 0, 0, docs))
    assert counts == every, f"missing {len(every - counts)} tokens, read twice {len(counts - every)}"


# -----------------------------------------------------------------------------
# the same world size: today's exact resume


def test_same_world_size_is_returned_untouched(tiny_data_dir: Path, tok: Tokenizer,
                                               docs: list[list[list[int]]]) -> None:
    world = World(tiny_data_dir, tok, docs, fresh(3), [2, 3, 4])
    for rank, batches in enumerate([5, 9, 2]):
        world.read(rank, batches)
    saved = world.states()
    for rank, original in enumerate(world.loaders):
        state = carry_over_position(saved, rank, 3, len(docs))
        assert state is saved[rank]
        resumed = StreamLoader(tiny_data_dir, tok, "train", original.batch_size, SEQ_LEN, rank, 3, state=state)
        for a, b in zip(take(original, 6), take(resumed, 6), strict=True):
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        assert resumed.state_dict() == original.state_dict()


# -----------------------------------------------------------------------------
# another world size: the rest of the epoch, every token once


# (old batch sizes, how far each old rank has read in shares of an epoch, new world size)
RESHARDS = {
    "2->3 uneven": ([2, 4], [0.4, 0.15], 3),
    "3->2 uneven": ([1, 2, 3], [0.1, 0.7, 0.3], 2),
    "2->3 one rank an epoch ahead": ([2, 2], [0.3, 1.4], 3),
    "3->2 one rank an epoch ahead": ([2, 2, 2], [1.6, 0.1, 0.5], 2),
    "3->2 two epochs apart": ([2, 2, 2], [2.3, 0.2, 1.1], 2),
    "2->1": ([2, 3], [0.5, 0.55], 1),
    "1->2": ([3], [0.6], 2),
}


@pytest.mark.parametrize("case", RESHARDS)
def test_rest_of_epoch_reads_every_token_once(tiny_data_dir: Path, tok: Tokenizer, docs: list[list[list[int]]],
                                              case: str) -> None:
    old_sizes, progress, new_world = RESHARDS[case]
    old = World(tiny_data_dir, tok, docs, fresh(len(old_sizes)), old_sizes)
    labels: list[Label] = []
    for rank, (loader, shares) in enumerate(zip(old.loaders, progress, strict=True)):
        share_tokens = sum(len(d) for group in docs[rank :: len(old_sizes)] for d in group)
        labels += old.read(rank, int(shares * share_tokens / (loader.batch_size * (SEQ_LEN + 1))))
    horizon = int(max(progress))
    assert max(epoch for epoch, *_ in labels) == horizon
    new_states = carry(old.states(), new_world, len(docs))
    assert {s["resume_epoch"] for s in new_states} == {horizon + 1}
    new = World(tiny_data_dir, tok, docs, new_states, [3] * new_world)
    labels += read_rest_of_carried_epochs(new, new_states)
    assert_each_token_once(labels, docs, horizon + 1)
    counts = [len(s["carried"]) for s in new_states]  # balanced by row group count
    assert max(counts) - min(counts) <= 1


def test_a_rank_on_its_epochs_last_token(tiny_data_dir: Path, tok: Tokenizer, docs: list[list[list[int]]]) -> None:
    """Right after the last token of an epoch the loader still stands in its last row group."""
    labels = list(itertools.islice(schedule(fresh(1)[0], docs), sum(len(d) for group in docs for d in group)))
    at_end = {**fresh(1)[0], "pair_index": len(docs) - 1, "doc_index": len(docs[-1])}
    new_states = carry([at_end], 2, len(docs))
    assert [s["carried"] for s in new_states] == [[[0, len(docs) - 1, len(docs[-1]), 0]], []]
    labels += read_rest_of_carried_epochs(World(tiny_data_dir, tok, docs, new_states, [2, 2]), new_states)
    assert_each_token_once(labels, docs, 1)


def test_carried_over_twice_reads_every_token_once(tiny_data_dir: Path, tok: Tokenizer,
                                                   docs: list[list[list[int]]]) -> None:
    """2 -> 3 mid-epoch, a checkpoint mid-way through the carried lists, then 3 -> 2."""
    first = World(tiny_data_dir, tok, docs, fresh(2), [2, 4])
    labels = first.read(0, 25) + first.read(1, 60)
    middle_states = carry(first.states(), 3, len(docs))
    middle = World(tiny_data_dir, tok, docs, middle_states, [4, 8, 6])
    for rank, batches in enumerate([60, 40, 50]):
        labels += middle.read(rank, batches)
    saved = middle.states()
    assert all("carried" in s and 0 < s["pair_index"] < len(s["carried"]) for s in saved)
    last_states = carry(saved, 2, len(docs))
    last = World(tiny_data_dir, tok, docs, last_states, [2, 2])
    labels += read_rest_of_carried_epochs(last, last_states)
    assert {s["resume_epoch"] for s in last_states} == {1}
    assert_each_token_once(labels, docs, 1)


def test_begun_row_group_continues_at_its_offset_on_one_rank(tiny_data_dir: Path, tok: Tokenizer,
                                                             docs: list[list[list[int]]]) -> None:
    old = World(tiny_data_dir, tok, docs, fresh(2), [3, 3])
    old.read(0, 11)
    old.read(1, 17)
    saved = old.states()
    begun = [(2 * s["pair_index"] + s["rank"], s["doc_index"], s["token_offset"]) for s in saved]
    assert all((doc, offset) != (0, 0) for _, doc, offset in begun)
    new_states = carry(saved, 3, len(docs))
    for pair, doc, offset in begun:
        holders = [(s, i) for s in new_states for i, item in enumerate(s["carried"]) if item[1] == pair]
        assert len(holders) == 1
        state, index = holders[0]
        assert index == 0 and state["carried"][0] == [0, pair, doc, offset]
        assert (state["doc_index"], state["token_offset"]) == (doc, offset)
        first = as_rows(next(StreamLoader(tiny_data_dir, tok, "train", 1, SEQ_LEN, state["rank"], 3, state=state)))
        assert first.flatten().tolist() == tokens_from(pair, doc, offset, docs)[: SEQ_LEN + 1]


# -----------------------------------------------------------------------------
# checkpoints of a carried-over loader, old-format states, refusals


@pytest.mark.parametrize("past_the_list", [False, True])
def test_carried_loaders_resume_at_the_same_size_exactly(tiny_data_dir: Path, tok: Tokenizer,
                                                          docs: list[list[list[int]]], past_the_list: bool) -> None:
    old = World(tiny_data_dir, tok, docs, fresh(2), [2, 3])
    old.read(0, 9)
    old.read(1, 14)
    middle = [StreamLoader(tiny_data_dir, tok, "train", 4, SEQ_LEN, s["rank"], 3, state=s)
              for s in carry(old.states(), 3, len(docs))]
    for loader in middle:
        take(loader, batches_to_read(loader, carried_tokens(loader.state_dict(), docs)) + 1 if past_the_list else 4)
    saved = [json.loads(json.dumps(loader.state_dict())) for loader in middle]
    assert all(("carried" in s) != past_the_list for s in saved)
    for rank, original in enumerate(middle):
        resumed = StreamLoader(tiny_data_dir, tok, "train", 4, SEQ_LEN, rank, 3,
                              state=carry_over_position(saved, rank, 3, len(docs)))
        for a, b in zip(take(original, 5), take(resumed, 5), strict=True):
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        assert resumed.state_dict() == original.state_dict()


def test_todays_states_load_and_carry_over(tiny_data_dir: Path, tok: Tokenizer, docs: list[list[list[int]]]) -> None:
    old = {"split": "train", "rank": 1, "world_size": 2, "epoch": 0, "pair_index": 3, "doc_index": 5,
           "token_offset": 2}
    loader = StreamLoader(tiny_data_dir, tok, "train", 1, SEQ_LEN, 1, 2, state=old)
    assert loader.state_dict() == old
    assert as_rows(next(loader)).flatten().tolist() == tokens_from(7, 5, 2, docs)[: SEQ_LEN + 1]
    saved = [{**old, "rank": 0, "pair_index": 4, "doc_index": 0, "token_offset": 0}, old]
    new_states = carry(saved, 1, len(docs))
    assert new_states[0]["carried"][:2] == [[0, 7, 5, 2], [0, 8, 0, 0]]


def test_val_carried_over_reads_its_rest_then_stops(tiny_data_dir: Path, tok: Tokenizer) -> None:
    val_docs = split_docs(tiny_data_dir, tok, "val")
    val = [StreamLoader(tiny_data_dir, tok, "val", 2, SEQ_LEN, r, 2) for r in range(2)]
    take(val[0], 5)
    assert list(itertools.islice(val[1], 1000))  # rank 1 has read its whole share
    saved = [loader.state_dict() for loader in val]
    row = 2 * (SEQ_LEN + 1)
    for rank in range(3):
        state = carry_over_position(saved, rank, 3, len(val_docs))
        assert state["resume_epoch"] == 1 and all(item[0] == 0 and item[1] % 2 == 0 for item in state["carried"])
        loader = StreamLoader(tiny_data_dir, tok, "val", 2, SEQ_LEN, rank, 3, state=state)
        got = [t for batch in itertools.islice(loader, 1000) for t in as_rows(batch).flatten().tolist()]
        expected = [val_docs[p][d][t] for item in state["carried"] for _, p, d, t in labelled(*item, val_docs)]
        assert got == expected[: len(expected) // row * row]  # a last partial batch is dropped, as ever
    assert [len(carry_over_position(saved, r, 3, len(val_docs))["carried"]) for r in range(3)] == [1, 1, 0]


def test_state_of_another_layout_not_carried_over_is_refused(tiny_data_dir: Path, tok: Tokenizer) -> None:
    state = fresh(2)[1]
    with pytest.raises(ValueError, match=r"loader state is for \{'split': 'train', 'rank': 1, 'world_size': 2\}, "
                                         r"this loader is \{'split': 'train', 'rank': 1, 'world_size': 3\}"):
        StreamLoader(tiny_data_dir, tok, "train", 2, SEQ_LEN, 1, 3, state=state)


@pytest.mark.parametrize("saved", [[], fresh(3)[:2], fresh(2)[::-1], [fresh(2)[0], {**fresh(2)[1], "split": "val"}]])
def test_an_incomplete_old_world_is_refused(saved: list[dict[str, Any]]) -> None:
    with pytest.raises(ValueError, match="must be those of ranks 0..W-1 of one world"):
        carry_over_position(saved, 0, 3, 28)


def test_a_position_beyond_the_data_is_refused() -> None:
    saved = fresh(2)
    saved[1]["pair_index"] = 15  # rank 1 of 2 has 14 of 28 row groups
    with pytest.raises(ValueError, match="does not fit a split of 28 row groups"):
        carry_over_position(saved, 0, 3, 28)
