"""Byte-level BPE tokenizer (HuggingFace `tokenizers`), trained on our own shards.

One file, `TOKDIR/tokenizer.json`, is the whole tokenizer: the controller trains it once and
pushes it to every node, and every rank hashes it at start (see docs/FAILURES.md row 1), so it
must be a single self-contained file.

    python -m nanochat_cpu.tokenizer train --data-dir D --vocab-size V --out TOKDIR
    python -m nanochat_cpu.tokenizer info --tokenizer-dir TOKDIR
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from .data import iter_texts

if TYPE_CHECKING:
    import torch

TOKENIZER_FILE = "tokenizer.json"
BOS = "<|bos|>"

# GPT-4 style split, written out piece by piece. Each alternative is tried in order at every
# position; BPE merges never cross the boundaries these pieces make.
_SPLIT_PIECES = (
    r"'(?i:[sdmt]|ll|ve|re)",  # English contractions ('s 'd 'm 't 'll 've 're), any case
    r"[^\r\n\p{L}\p{N}]?\p{L}+",  # a word, with at most one leading non-letter (usually its space)
    r"\p{N}{1,3}",  # digits in groups of at most three, so numbers don't eat the vocab
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",  # a punctuation run, its leading space and trailing newlines
    r"\s*[\r\n]+",  # newlines, with the spaces before them
    r"\s+(?!\S)",  # spaces not followed by text: leave the last one to the next word
    r"\s+",  # any other whitespace
)
SPLIT_PATTERN = "|".join(_SPLIT_PIECES)

# Cap each document during training: a few huge documents would otherwise dominate the pair
# counts (nanochat does the same).
DOC_CAP_CHARS = 10_000


def build_untrained(vocab_size: int) -> tuple[HFTokenizer, trainers.BpeTrainer]:
    """The empty tokenizer pipeline and its trainer."""
    # 256 byte symbols + BOS is the smallest vocab that can still encode every string.
    min_vocab = len(pre_tokenizers.ByteLevel.alphabet()) + 1
    if vocab_size < min_vocab:
        raise ValueError(f"--vocab-size {vocab_size} is below {min_vocab} (256 bytes + {BOS})")
    tok = HFTokenizer(models.BPE())
    # The split regex cuts text into pieces; ByteLevel then maps every byte to a printable
    # symbol. use_regex=False: our regex already split, GPT-2's built-in one must not run too.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=[BOS],
        # all 256 byte symbols are in the vocab from the start, so any text round-trips
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    return tok, trainer


def _training_texts(data_dir: Path, max_chars: int) -> Iterator[list[str]]:
    """Row groups of the train split (never the val shard), capped, up to max_chars in total."""
    seen = 0
    for texts in iter_texts(data_dir, "train"):
        batch = [t[:DOC_CAP_CHARS] for t in texts]
        yield batch
        seen += sum(len(t) for t in batch)
        if seen >= max_chars:
            return


def train(data_dir: str | Path, vocab_size: int, out_dir: str | Path, max_chars: int = 2_000_000_000) -> Path:
    """Train on the train shards of data_dir; write out_dir/tokenizer.json atomically."""
    tok, trainer = build_untrained(vocab_size)
    tok.train_from_iterator(_training_texts(Path(data_dir), max_chars), trainer=trainer)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / TOKENIZER_FILE
    tmp = path.with_name(path.name + ".tmp")
    tok.save(str(tmp), pretty=False)
    os.replace(tmp, path)
    return path


class Tokenizer:
    """A trained tokenizer.json plus the few things the trainer needs from it."""

    def __init__(self, raw: bytes, source: str = "<bytes>") -> None:
        self._raw = raw
        self._hf = HFTokenizer.from_str(raw.decode("utf-8"))
        # A document that happens to contain the text "<|bos|>" must stay text; only the
        # loader places BOS tokens, at real document starts.
        self._hf.encode_special_tokens = True
        bos = self._hf.token_to_id(BOS)
        if bos is None:
            raise ValueError(f"{source}: no {BOS} token; train it with `python -m nanochat_cpu.tokenizer train`")
        self.bos_id: int = bos
        self.vocab_size: int = self._hf.get_vocab_size(with_added_tokens=True)

    @classmethod
    def load(cls, tokdir: str | Path) -> Tokenizer:
        path = Path(tokdir) / TOKENIZER_FILE
        return cls(path.read_bytes(), source=str(path))

    def encode(self, text: str) -> list[int]:
        return self._hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str], num_threads: int | None = None) -> list[list[int]]:
        """Encode many texts. num_threads=1 encodes in this thread only (for a rank that
        already owns its cores); otherwise the library's thread pool is used, whose size is
        process-wide: RAYON_NUM_THREADS, default all cores."""
        if num_threads == 1:
            return [self.encode(t) for t in texts]
        return [e.ids for e in self._hf.encode_batch_fast(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._hf.decode(list(ids), skip_special_tokens=False)

    def content_hash(self) -> str:
        """sha256 of tokenizer.json: ranks compare it before step 0."""
        return hashlib.sha256(self._raw).hexdigest()

    def token_bytes(self) -> torch.Tensor:
        """UTF-8 length of each token id (0 for special tokens), for bits-per-byte."""
        import torch  # here, not at the top: `train` and `info` should start fast without it

        byte_symbols = set(pre_tokenizers.ByteLevel.alphabet())
        special = {t.content for t in self._hf.get_added_tokens_decoder().values()}
        lengths = torch.zeros(self.vocab_size, dtype=torch.int32)
        for token_id in range(self.vocab_size):
            token = self._hf.id_to_token(token_id)
            if token is None or token in special:
                continue
            # Byte-level vocab: every symbol of a token stands for exactly one byte.
            if not set(token) <= byte_symbols:
                raise ValueError(f"token {token_id} {token!r} is not byte-level; is this our tokenizer.json?")
            lengths[token_id] = len(token)
        return lengths


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nanochat_cpu.tokenizer", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_train = sub.add_parser("train", help="train tokenizer.json on the train shards of a data dir")
    p_train.add_argument("--data-dir", required=True, type=Path)
    p_train.add_argument("--vocab-size", required=True, type=int)
    p_train.add_argument("--out", required=True, type=Path, help="tokenizer dir to write tokenizer.json into")
    p_train.add_argument("--max-chars", type=int, default=2_000_000_000, help="stop reading after this many chars")
    p_info = sub.add_parser("info", help="print vocab size, BOS id and content hash")
    p_info.add_argument("--tokenizer-dir", required=True, type=Path)
    args = parser.parse_args(argv)

    if args.cmd == "train":
        try:
            path = train(args.data_dir, args.vocab_size, args.out, args.max_chars)
        except (FileNotFoundError, ValueError) as e:
            print(f"tokenizer train: {e}", file=sys.stderr)
            return 2
        tok = Tokenizer.load(args.out)
        if tok.vocab_size < args.vocab_size:
            print(f"note: corpus too small for {args.vocab_size} tokens; got {tok.vocab_size}")
        print(f"wrote {path}: vocab {tok.vocab_size}, bos id {tok.bos_id}, sha256 {tok.content_hash()}")
        return 0
    tok = Tokenizer.load(args.tokenizer_dir)
    print(f"vocab_size {tok.vocab_size}")
    print(f"bos_id {tok.bos_id}")
    print(f"sha256 {tok.content_hash()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
