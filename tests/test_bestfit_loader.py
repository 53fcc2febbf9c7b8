"""Best-fit packing on the real loader: rows start at documents, a giant document costs one row,
the buffer resumes exactly and is dealt out with the rest of the epoch to a new world size.

Every row is checked token for token against the documents its placements name, which are read
here from the parquet shards with the tokenizer, so the coverage checks below are about what the
loaders really yield.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import torch
from conftest import english_like_docs

from nanochat_cpu import data, dataset_build
from nanochat_cpu.dataloader import TokenLoader, carry_over_position, cropping_cost, packing_mismatch
from nanochat_cpu.tokenizer import Tokenizer

SEQ_LEN = 64
Ref = tuple[int, int, int]  # epoch, global pair index, document


@pytest.fixture(scope="module")
def tok(tiny_tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer.load(tiny_tokenizer_dir)


def split_docs(data_dir: Path, tok: Tokenizer, split: str) -> list[list[list[int]]]:
    """Every row group's BOS-prefixed documents, by global pair index."""
    manifest = data.read_manifest(data_dir)
    groups = []
    for name in data.split_files(manifest, split):
        shard = pq.ParquetFile(data_dir / name)
        for group in range(shard.num_row_groups):
            texts = shard.read_row_group(group).column("text").to_pylist()
            groups.append([[tok.bos_id, *tok.encode(text)] for text in texts])
    return groups


def read_checked(loader: TokenLoader, docs: list[list[list[int]]], batches: int) -> list[tuple[Ref, int, int]]:
    """Up to `batches` batches (fewer where val ends), each row checked against the documents its
    placements name: whole ones, then at most one cropped at the row's end. The placements, flat."""
    placed = []
    for inputs, targets in itertools.islice(loader, batches):
        rows = torch.cat([inputs, targets[:, -1:]], dim=1).tolist()
        assert len(loader.placements) == len(rows)
        for row, row_placed in zip(rows, loader.placements, strict=True):
            expected = []
            for k, (ref, taken, length) in enumerate(row_placed):
                doc = docs[ref[1]][ref[2]]
                assert length == len(doc) and 0 < taken <= length
                assert taken == length or k == len(row_placed) - 1, "only a row's last document is cropped"
                expected += doc[:taken]
            assert row == expected and row[0] == loader.tokenizer.bos_id
            placed += [(tuple(ref), taken, length) for ref, taken, length in row_placed]
    return placed


def as_json(state: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(state))  # as a checkpoint keeps it: plain ints and lists


@pytest.fixture(scope="module")
def giant_data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Prose and one repetitive document about 60 rows long, in the train shards."""
    out = tmp_path_factory.mktemp("giant_data")
    docs = english_like_docs(700, seed=3)
    docs[100] = "GIANT " + "%%EndPage showpage gsave 12 34 moveto " * 400
    dataset_build.write_shards(docs, out, rows_per_group=50, groups_per_shard=3, val_docs=100, seed=0)
    return out


# -----------------------------------------------------------------------------
# the rows


def test_rows_start_at_documents_whole_ones_then_one_crop(tiny_data_dir: Path, tok: Tokenizer) -> None:
    docs = split_docs(tiny_data_dir, tok, "train")
    loader = TokenLoader(tiny_data_dir, tok, "train", 4, SEQ_LEN, rank=1, world_size=3)
    placed = read_checked(loader, docs, 20)
    assert all(ref[1] % 3 == 1 for ref, _, _ in placed), "a rank reads only its own row groups"
    refs = [ref for ref, _, _ in placed]
    assert len(refs) == len(set(refs)), "no document twice in an epoch"
    whole = sum(taken for _, taken, length in placed if taken == length)
    assert whole > 0.8 * 20 * 4 * (SEQ_LEN + 1), "best fit fills rows mostly with whole documents"


def test_one_giant_document_costs_at_most_one_row_an_epoch(giant_data_dir: Path, tok: Tokenizer) -> None:
    docs = split_docs(giant_data_dir, tok, "train")
    giant = next((p, d) for p, group in enumerate(docs) for d, doc in enumerate(group) if len(doc) > 40 * SEQ_LEN)
    epoch_tokens = sum(len(doc) for group in docs for doc in group)
    batches = 3 * epoch_tokens // (4 * (SEQ_LEN + 1))  # about three epochs
    loader = TokenLoader(giant_data_dir, tok, "train", 4, SEQ_LEN, buffer_docs=64)
    placed = read_checked(loader, docs, batches)
    assert loader.epoch >= 2
    # it waits in the buffer until the stream comes back to it, then gives the row it is cropped to
    rows_of_giant = Counter(ref[0] for ref, _, _ in placed if ref[1:] == giant)
    assert len(rows_of_giant) >= 2 and set(rows_of_giant.values()) == {1}, rows_of_giant
    # buffered, it holds a row's worth, not the whole document
    assert max(len(doc) for _, doc, _ in loader._buffer.values()) <= SEQ_LEN + 1
    # the stream packing reads it whole, every epoch: the 40-odd rows of it in a row that wrecked a model
    stream = TokenLoader(giant_data_dir, tok, "train", 4, SEQ_LEN, packing="stream")
    rows = torch.cat([torch.cat([x, y[:, -1:]], 1) for x, y in itertools.islice(stream, batches)])
    giant_ids = torch.tensor(sorted(set(docs[giant[0]][giant[1]][1:])))
    only_giant = torch.isin(rows, giant_ids).all(dim=1)
    assert int(only_giant.sum()) >= 2 * 40


def test_val_places_each_document_once_and_keeps_the_rest_buffered(tiny_data_dir: Path, tok: Tokenizer) -> None:
    docs = split_docs(tiny_data_dir, tok, "val")
    loader = TokenLoader(tiny_data_dir, tok, "val", 8, SEQ_LEN, buffer_docs=32)
    placed = read_checked(loader, docs, 10_000)
    assert placed and len(list(itertools.islice(loader, 1))) == 0
    leftover = [tuple(ref) for ref in loader.state_dict()["buffer"]]
    every = Counter((0, p, d) for p, group in enumerate(docs) for d in range(len(group)))
    assert Counter([ref for ref, _, _ in placed] + leftover) == every


# -----------------------------------------------------------------------------
# exact resume, and another world size


@pytest.mark.parametrize("skip", [0, 1, 9, "epoch"])
def test_resume_mid_buffer_yields_the_same_batches(tiny_data_dir: Path, tok: Tokenizer, skip: int | str) -> None:
    args = (tiny_data_dir, tok, "train", 4, SEQ_LEN)
    original = TokenLoader(*args, rank=2, world_size=3, buffer_docs=50)
    if skip == "epoch":  # past the first pass over the rank's row groups: the buffer spans two epochs
        docs = split_docs(tiny_data_dir, tok, "train")
        skip = sum(len(doc) for group in docs[2::3] for doc in group) // (4 * (SEQ_LEN + 1))
    list(itertools.islice(original, skip))
    state = as_json(original.state_dict())
    assert len(state["buffer"]) == (50 - 1 if skip else 0)  # filled before each pick, less the last one taken
    resumed = TokenLoader(*args, rank=2, world_size=3, state=state, buffer_docs=50)
    for a, b in zip(itertools.islice(original, 5), itertools.islice(resumed, 5), strict=True):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert resumed.state_dict() == original.state_dict()
    epochs = {ref[0] for ref in resumed.state_dict()["buffer"]}
    assert len(epochs) > 1 if skip > 9 else epochs <= {0}


@pytest.mark.parametrize(("old", "new"), [(2, 3), (3, 2), (4, 1)])
def test_another_world_size_places_each_val_document_once(tiny_data_dir: Path, tok: Tokenizer, old: int,
                                                          new: int) -> None:
    docs = split_docs(tiny_data_dir, tok, "val")
    loaders = [TokenLoader(tiny_data_dir, tok, "val", 2, SEQ_LEN, r, old, buffer_docs=16) for r in range(old)]
    placed = [p for loader in loaders for p in read_checked(loader, docs, 3)]
    saved = [as_json(loader.state_dict()) for loader in loaders]
    states = [carry_over_position(saved, r, new, len(docs)) for r in range(new)]
    assert sorted(ref for s in states for ref in s["buffer"]) == sorted(ref for s in saved for ref in s["buffer"])
    resumed = [TokenLoader(tiny_data_dir, tok, "val", 2, SEQ_LEN, r, new, state=s, buffer_docs=16)
               for r, s in enumerate(states)]
    placed += [p for loader in resumed for p in read_checked(loader, docs, 10_000)]
    leftover = [tuple(ref) for loader in resumed for ref in loader.state_dict()["buffer"]]
    every = Counter((0, p, d) for p, group in enumerate(docs) for d in range(len(group)))
    assert Counter([ref for ref, _, _ in placed] + leftover) == every


def test_another_world_size_reads_each_train_document_once_an_epoch(tiny_data_dir: Path, tok: Tokenizer) -> None:
    docs = split_docs(tiny_data_dir, tok, "train")
    loaders = [TokenLoader(tiny_data_dir, tok, "train", b, SEQ_LEN, r, 2, buffer_docs=40)
               for r, b in enumerate([6, 2])]  # uneven batches: the ranks stand at different places
    placed = [p for loader in loaders for p in read_checked(loader, docs, 12)]
    saved = [as_json(loader.state_dict()) for loader in loaders]
    states = [carry_over_position(saved, r, 3, len(docs)) for r in range(3)]
    resumed = [TokenLoader(tiny_data_dir, tok, "train", 3, SEQ_LEN, r, 3, state=s, buffer_docs=40)
               for r, s in enumerate(states)]
    horizon = states[0]["resume_epoch"]
    for loader in resumed:  # each new rank reads past its carried list, into the normal epochs
        for _ in range(1000):
            placed += read_checked(loader, docs, 1)
            if loader.carried is None and all(ref[0] >= horizon for ref, _, _ in loader.placements[-1]):
                break
        assert loader.carried is None
    taken = [ref for ref, _, _ in placed] + [tuple(ref) for loader in resumed
                                              for ref in loader.state_dict()["buffer"]]
    before = Counter(ref for ref in taken if ref[0] < horizon)
    assert before == Counter((e, p, d) for e in range(horizon) for p, group in enumerate(docs)
                             for d in range(len(group)))


def test_a_share_smaller_than_the_buffer_never_holds_a_document_twice(tiny_data_dir: Path, tok: Tokenizer) -> None:
    """448 documents a rank against a buffer of 1,000: the next epoch's copy of a document waits
    until this one is placed, so no row holds one document twice."""
    docs = split_docs(tiny_data_dir, tok, "train")
    loader = TokenLoader(tiny_data_dir, tok, "train", 8, 2048, rank=1, world_size=4)
    for _ in range(12):
        placed = read_checked(loader, docs, 1)
        for row in loader.placements:
            in_row = [tuple(ref[1:]) for ref, _, _ in row]
            assert len(in_row) == len(set(in_row)), "one document twice in a row"
        buffered = [tuple(ref[1:]) for ref in loader.state_dict()["buffer"]]
        assert len(buffered) == len(set(buffered)) and len(buffered) <= 448
    assert loader.epoch >= 2 and placed


def test_a_batch_size_change_reads_on_from_the_same_buffer(tiny_data_dir: Path, tok: Tokenizer) -> None:
    docs = split_docs(tiny_data_dir, tok, "train")
    loader = TokenLoader(tiny_data_dir, tok, "train", 4, SEQ_LEN)
    placed = read_checked(loader, docs, 3)
    loader.batch_size = 7  # a re-split gives the rank another number of rows
    placed += read_checked(loader, docs, 3)
    refs = [ref for ref, _, _ in placed]
    assert len(refs) == len(set(refs))


# -----------------------------------------------------------------------------
# a position saved with one packing, resumed with the other


def test_packing_changes_only_where_nothing_is_lost(tiny_data_dir: Path, tok: Tokenizer) -> None:
    bestfit = TokenLoader(tiny_data_dir, tok, "train", 2, SEQ_LEN)
    next(bestfit)
    stream = TokenLoader(tiny_data_dir, tok, "train", 2, SEQ_LEN, packing="stream")
    next(stream)
    assert "--packing bestfit, this run packs with --packing stream: resume with --packing bestfit" in str(
        packing_mismatch(bestfit.state_dict(), "stream"))
    with pytest.raises(ValueError, match="saved with --packing stream"):
        TokenLoader(tiny_data_dir, tok, "train", 2, SEQ_LEN, state=stream.state_dict())
    # a position written before best-fit existed, at a document's start, goes on best-fit
    old = {k: v for k, v in stream.state_dict().items() if k != "packing"} | {"doc_index": 3, "token_offset": 0}
    assert packing_mismatch(old, "bestfit") is None
    # a carried-over list's row groups already read do not count, those to come do
    carried = old | {"carried": [[0, 1, 4, 9], [0, 3, 0, 0], [0, 5, 2, 0]], "resume_epoch": 1, "pair_index": 1}
    assert packing_mismatch(carried, "bestfit") is None
    carried["carried"][2][3] = 7
    assert "resume with --packing stream (train.yml: -e packing=stream)" in str(packing_mismatch(carried, "bestfit"))
    resumed = TokenLoader(tiny_data_dir, tok, "train", 2, SEQ_LEN, state=old)
    assert next(resumed)[0].shape == (2, SEQ_LEN) and resumed.state_dict()["buffer"]


def test_cropping_cost_counts_what_crops_leave_unread(tiny_data_dir: Path, tok: Tokenizer) -> None:
    long_rows = cropping_cost(TokenLoader(tiny_data_dir, tok, "train", 2, 2048), 5)
    short_rows = cropping_cost(TokenLoader(tiny_data_dir, tok, "train", 2, 8), 50)
    assert long_rows["row_tokens"] == 5 * 2 * 2049
    assert long_rows["cropped_share"] < 0.05 < 0.3 < short_rows["cropped_share"] < 1
    assert long_rows["whole_share"] > 0.9 > short_rows["whole_share"]
