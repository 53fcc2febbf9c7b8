"""Shared fixtures: a small real dataset and a tokenizer trained on it, built once per session.

Both live under a session tmp dir and are shared by every test: treat them as read-only
(copy with shutil.copytree before changing anything).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from nanochat_cpu import dataset_build, tokenizer

TINY_DOCS = 2048  # 1792 train docs = 7 shards x 4 row groups of 64; val = 4 row groups of 64
TINY_ROWS_PER_GROUP = 64
TINY_GROUPS_PER_SHARD = 4
TINY_VAL_DOCS = 256
TINY_VOCAB = 512

_WORDS = (
    "the of and to in is was that for it with as his on be at by had are but from or have an they which one "
    "you were her all she there would their we him been has when who will more no if out so said what up its "
    "about into than them can only other new some could time these two may then do first any my now such like "
    "our over man me even most made after also did many before must through back years where much your way "
    "well down should because each just those people how too little state good very make world still own see "
    "men work long get here between both life being under never day same another know while last might great"
).split()


def english_like_docs(n: int, seed: int = 0) -> list[str]:
    """Sentences of common English words: the stand-in when `fortunes` is not installed."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        sentences = []
        for _ in range(rng.randint(1, 4)):
            words = rng.choices(_WORDS, k=rng.randint(4, 14))
            sentences.append(" ".join(words).capitalize() + rng.choice(".!?"))
        docs.append(" ".join(sentences))
    return docs


def tiny_documents() -> list[str]:
    files = dataset_build.fortune_files()
    return dataset_build.collect_documents(files)[:TINY_DOCS] if files else english_like_docs(TINY_DOCS)


@pytest.fixture(scope="session")
def tiny_data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """8 shards (7 train + val), 4 row groups of 64 documents each, real English text."""
    out = tmp_path_factory.mktemp("tiny_data")
    dataset_build.write_shards(
        tiny_documents(),
        out,
        rows_per_group=TINY_ROWS_PER_GROUP,
        groups_per_shard=TINY_GROUPS_PER_SHARD,
        val_docs=TINY_VAL_DOCS,
        seed=0,
    )
    return out


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory, tiny_data_dir: Path) -> Path:
    """Byte-level BPE with TINY_VOCAB tokens trained on tiny_data_dir's train shards."""
    out = tmp_path_factory.mktemp("tiny_tokenizer")
    tokenizer.train(tiny_data_dir, TINY_VOCAB, out)
    return out
