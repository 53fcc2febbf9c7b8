"""Tokenizer: trained for real on small shards, then round-tripped, hashed and measured."""

from __future__ import annotations

import hashlib
import random
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import TINY_VOCAB, english_like_docs

from nanochat_cpu import data, tokenizer
from nanochat_cpu.tokenizer import BOS, Tokenizer

TRICKY = [
    "",
    " ",
    "Hello, world!",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\nand\n\n\nblank lines",
    "numbers 0 12 345 6789 3.14159 1,000,000",
    "It's, I'LL, we've, they're, she'd",
    "naïve café, Zürich, São Paulo, Ærøskøbing",
    "日本語のテキスト、中文文本，한국어 텍스트",
    "emoji 🙂👍🏽 👨‍👩‍👧 flags 🇩🇪🇯🇵",
    "combining: e\u0301 a\u0308 and zero\u200bwidth",
    "right-to-left: עברית العربية",
    "control \x00\x01\x07\x1b[31m\x7f bytes",
    "<|bos|> looks special but is text",
    "\U0010ffff\ue000 private use",
]


def random_text(rng: random.Random) -> str:
    """A string of code points from everywhere in Unicode except the surrogates."""
    ranges = [(0x00, 0x7F), (0x80, 0x7FF), (0x800, 0xD7FF), (0xE000, 0xFFFF), (0x10000, 0x10FFFF)]
    chars = []
    for _ in range(rng.randint(0, 40)):
        lo, hi = rng.choice(ranges)
        chars.append(chr(rng.randint(lo, hi)))
    return "".join(chars)


@pytest.fixture(scope="module")
def tok(tiny_tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer.load(tiny_tokenizer_dir)


def test_train_writes_one_file_with_requested_vocab(tiny_tokenizer_dir: Path, tok: Tokenizer) -> None:
    assert sorted(p.name for p in tiny_tokenizer_dir.iterdir()) == ["tokenizer.json"]
    assert tok.vocab_size == TINY_VOCAB
    assert tok.decode([tok.bos_id]) == BOS


@pytest.mark.parametrize("text", TRICKY)
def test_round_trip_tricky(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_round_trip_random_unicode(tok: Tokenizer) -> None:
    rng = random.Random(0)
    texts = [random_text(rng) for _ in range(300)]
    for text, ids in zip(texts, tok.encode_batch(texts), strict=True):
        assert tok.decode(ids) == text


def test_every_byte_is_a_token(tok: Tokenizer) -> None:
    # With all 256 bytes in the vocab, any byte string (including partial UTF-8) is encodable.
    lengths = tok.token_bytes()
    single = [i for i in range(tok.vocab_size) if lengths[i] == 1]
    decoded = {tok.decode([i]).encode("utf-8", errors="surrogatepass") for i in single}
    assert len(single) == 256
    assert {bytes([b]) for b in range(128)} <= decoded  # ASCII decodes to itself; the rest are partial UTF-8


def test_bos_only_where_placed(tok: Tokenizer) -> None:
    ids = tok.encode("a <|bos|> b")
    assert tok.bos_id not in ids
    assert tok.decode([tok.bos_id, *ids]) == "<|bos|>a <|bos|> b"


def test_encode_batch_matches_encode(tok: Tokenizer) -> None:
    texts = TRICKY + english_like_docs(50)
    expected = [tok.encode(t) for t in texts]
    assert tok.encode_batch(texts) == expected
    assert tok.encode_batch(texts, num_threads=1) == expected


def test_token_bytes_sum_to_utf8_length(tok: Tokenizer) -> None:
    lengths = tok.token_bytes()
    assert lengths.dtype == torch.int32 and lengths.shape == (tok.vocab_size,)
    assert lengths[tok.bos_id] == 0
    for text in TRICKY + english_like_docs(20):
        ids = tok.encode(text)
        assert int(lengths[ids].sum()) == len(text.encode("utf-8"))


def test_hash_is_sha256_of_file_and_training_is_reproducible(
    tiny_data_dir: Path, tiny_tokenizer_dir: Path, tok: Tokenizer, tmp_path: Path
) -> None:
    raw = (tiny_tokenizer_dir / "tokenizer.json").read_bytes()
    assert tok.content_hash() == hashlib.sha256(raw).hexdigest()
    assert Tokenizer.load(tiny_tokenizer_dir).content_hash() == tok.content_hash()
    tokenizer.train(tiny_data_dir, TINY_VOCAB, tmp_path)
    assert Tokenizer.load(tmp_path).content_hash() == tok.content_hash()


@pytest.mark.parametrize("val_is_odd", [True, False])
def test_trains_on_train_shards_only(tmp_path: Path, val_is_odd: bool) -> None:
    # A word that fills one shard and appears nowhere else becomes tokens exactly when that
    # shard is a train shard (the False case shows the check can see it).
    d = tmp_path / "d"
    d.mkdir()
    shards = {"shard_00000.parquet": ["zqxvjk " * 20] * 50, "shard_00001.parquet": english_like_docs(300, seed=1)}
    for name, docs in shards.items():
        pq.write_table(pa.table({"text": docs}), d / name, row_group_size=100)
    if val_is_odd:  # the odd shard last, as val
        names = ["shard_00001.parquet", "shard_00000.parquet"]
    else:
        names = ["shard_00000.parquet", "shard_00001.parquet"]
    data.write_manifest(d, [data.file_entry(d / n) for n in names], val_file=names[-1])
    tokenizer.train(d, 300, tmp_path / "t")
    tok = Tokenizer.load(tmp_path / "t")
    pieces = [tok.decode([i]).strip() for i in range(tok.vocab_size)]
    assert any(len(p) >= 2 and p in "zqxvjk" for p in pieces) is not val_is_odd
    assert any(len(p) >= 3 and p in "the other people" for p in pieces) is val_is_odd


def test_vocab_too_small_is_refused(tiny_data_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="256 bytes"):
        tokenizer.train(tiny_data_dir, 100, tmp_path)


def test_missing_bos_is_named(tmp_path: Path) -> None:
    from tokenizers import Tokenizer as HF
    from tokenizers import models

    HF(models.BPE()).save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match="tokenizer.json: no <\\|bos\\|> token"):
        Tokenizer.load(tmp_path)


def test_info_cli(tiny_tokenizer_dir: Path, tok: Tokenizer) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "nanochat_cpu.tokenizer", "info", "--tokenizer-dir", str(tiny_tokenizer_dir)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert res.stdout.split() == ["vocab_size", "512", "bos_id", str(tok.bos_id), "sha256", tok.content_hash()]


def test_train_cli(tiny_data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = tokenizer.main(["train", "--data-dir", str(tiny_data_dir), "--vocab-size", "300", "--out", str(tmp_path)])
    assert rc == 0
    assert f"vocab 300, bos id {Tokenizer.load(tmp_path).bos_id}" in capsys.readouterr().out
