"""Building a data dir: the three ways shards and a manifest get written.

`prepare` turns text files (or directories of them) into shards, printing the corpus report and
applying its remedies on request; `corpus` does the same for every Debian fortune, the offline
demo corpus; `fetch` downloads ClimbMix shards as nanochat lays them out (`download.py` moves the
bytes). All of them end in `write_manifest`: the format they write, and `verify` that reads it
back, are data.py's, as is the command line (`python -m nanochat_cpu.data prepare|corpus|fetch`).
"""

from __future__ import annotations

import math
import os
import random
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from .corpus_report import (
    LONG_DOC_ACTIONS,
    LONG_DOC_CHARS,
    VAL_DOC_SHARE,
    Docs,
    cap_long_documents,
    choose_val,
    corpus_report,
    dedupe_documents,
    drop_non_text,
    removed_line,
    report_lines,
    val_share_line,
)
from .data import MANIFEST, file_entry, shard_docs, shard_name, staging_path, write_manifest
from .download import download, part_path

FORTUNES_DIR = Path("/usr/share/games/fortunes")
# Fortune files that are pictures rather than prose.
FORTUNES_SKIP = frozenset({"art", "ascii-art"})
# nanochat's pretraining data: ClimbMix, shard_00000 ... shard_06542, the last pinned as val.
DEFAULT_BASE_URL = "https://huggingface.co/datasets/karpathy/climbmix-400b-shuffle/resolve/main"
DEFAULT_VAL_INDEX = 6542


# -----------------------------------------------------------------------------
# Text files -> documents -> shards

_FORTUNE_SEPARATOR = re.compile(r"^%[ \t]*$", re.MULTILINE)
_BLANK_LINES = re.compile(r"\n[ \t]*\n")
# Old fortune files underline and embolden with backspaces ("_\bW", "W\bW"); keep what shows.
_OVERSTRIKE = re.compile(r"[^\n]\x08")


def read_documents(path: Path) -> list[str]:
    """A fortune file (entries between lines of just `%`) or plain text (paragraphs)."""
    text = path.read_bytes().decode("utf-8", errors="replace").replace("\r\n", "\n")
    text = _OVERSTRIKE.sub("", text)
    separator = _FORTUNE_SEPARATOR if _FORTUNE_SEPARATOR.search(text) else _BLANK_LINES
    docs = (part.strip("\n").rstrip() for part in separator.split(text))
    return [d for d in docs if d.strip()]


def _looks_like_text(path: Path) -> bool:
    with open(path, "rb") as f:
        return b"\x00" not in f.read(8192)


def source_files(sources: Sequence[str | Path]) -> list[Path]:
    """Files named, and text files under directories named, in a stable order."""
    files: list[Path] = []
    for source in map(Path, sources):
        if source.is_file():
            files.append(source)
        elif source.is_dir():
            found = sorted(p for p in source.rglob("*") if p.is_file() and not p.name.startswith("."))
            files.extend(p for p in found if _looks_like_text(p))
        else:
            raise FileNotFoundError(f"--source {source}: no such file or directory")
    return files


def collect_named_documents(sources: Sequence[str | Path]) -> list[tuple[str, str]]:
    """(name, text) of every document: the name says which file to look at when one is flagged."""
    docs: list[tuple[str, str]] = []
    for path in source_files(sources):
        docs.extend((f"{path} doc {i}", text) for i, text in enumerate(read_documents(path), start=1))
    return docs


def collect_documents(sources: Sequence[str | Path]) -> list[str]:
    return [text for _, text in collect_named_documents(sources)]


def _write_shard(path: Path, docs: list[str], rows_per_group: int) -> None:
    table = pa.table({"text": pa.array(docs, type=pa.string())})
    tmp = staging_path(path)
    pq.write_table(table, tmp, row_group_size=rows_per_group, compression="zstd")
    os.replace(tmp, path)


def write_shards(
    docs: Sequence[str],
    out: str | Path,
    rows_per_group: int = 1024,
    groups_per_shard: int = 4,
    val_docs: int | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Shuffle docs (seeded), write train shards then one val shard, then the manifest.

    An outlier (`choose_val`) that the shuffle puts in the val shard goes to train instead:
    val_bpb must measure the corpus, not one PostScript file."""
    if rows_per_group < 1 or groups_per_shard < 1:
        raise ValueError("--rows-per-group and --groups-per-shard must be at least 1")
    docs = list(docs)
    per_shard = rows_per_group * groups_per_shard
    if val_docs is None:
        val_docs = max(1, min(per_shard, len(docs) // 10))
    if not 1 <= val_docs < len(docs):
        raise ValueError(f"need 1 <= val docs < {len(docs)} documents, got {val_docs}")
    random.Random(seed).shuffle(docs)
    chosen, outliers = choose_val(docs, val_docs)
    train = [d for i, d in enumerate(docs) if i not in chosen]
    val = [d for i, d in enumerate(docs) if i in chosen]
    moved = [len(docs[i]) for i in range(len(docs) - val_docs, len(docs)) if i not in chosen]
    if moved:
        print(f"val shard: {len(moved)} outlier document(s), {sum(moved):,} characters, went to train instead "
              f"(non-text, over {LONG_DOC_CHARS:,} characters, or alone over {VAL_DOC_SHARE:.0%} of the val shard)")
    if outliers > 0.05 * len(docs):  # a corpus that is mostly such documents: its val is not like it
        print(f"val shard: {outliers:,} of {len(docs):,} documents ({outliers / len(docs):.0%}) are kept out of it "
              f"as outliers: val_bpb measures the rest of the corpus")
    chunks = [train[i : i + per_shard] for i in range(0, len(train), per_shard)] + [val]

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    # No manifest while shards are rewritten: a half-written dir must never look valid.
    (out / MANIFEST).unlink(missing_ok=True)
    entries = []
    for index, chunk in enumerate(chunks):
        path = out / shard_name(index)
        _write_shard(path, chunk, rows_per_group)
        entries.append(file_entry(path))
    names = {e["file"] for e in entries}
    for stale in out.glob("shard_*.parquet"):
        if stale.name not in names:
            stale.unlink()
    return write_manifest(out, entries, val_file=entries[-1]["file"])


def prepare(
    sources: Sequence[str | Path],
    out: str | Path,
    rows_per_group: int = 1024,
    groups_per_shard: int = 4,
    val_docs: int | None = None,
    seed: int = 0,
    max_doc_chars: int = LONG_DOC_CHARS,
    long_docs: str = "warn",
    drop_binary: bool = False,
    dedupe: bool = False,
) -> dict[str, Any]:
    """Text files (or dirs of them) -> shards + manifest in out, printing the corpus report.

    The options act on the outliers the report names; each says what it removed. By default
    nothing is removed and only the val shard's pick avoids outliers (see write_shards)."""
    if long_docs not in LONG_DOC_ACTIONS:
        raise ValueError(f"--long-docs must be one of {', '.join(LONG_DOC_ACTIONS)}, got {long_docs!r}")
    if max_doc_chars < 1:
        raise ValueError(f"--max-doc-chars must be at least 1, got {max_doc_chars}")
    docs = collect_named_documents(sources)
    if drop_binary:
        docs, removed = drop_non_text(docs)
        print(removed_line("--drop-binary", removed))
    if dedupe:
        docs, removed = dedupe_documents(docs)
        print(removed_line("--dedupe", removed))
    if long_docs != "warn":
        docs, removed = cap_long_documents(docs, max_doc_chars, long_docs)
        verb = "to" if long_docs == "crop" else "over"
        print(removed_line(f"--long-docs {long_docs} ({verb} {max_doc_chars:,} characters)", removed))
    names, texts = [name for name, _ in docs], [text for _, text in docs]
    print("\n".join(report_lines(corpus_report([Docs("all", "", names, texts)], max_doc_chars=max_doc_chars))))
    # the val pick does not follow --max-doc-chars: a cap given only to see warnings leaves the split alone
    manifest = write_shards(texts, out, rows_per_group, groups_per_shard, val_docs, seed)
    print(val_share_line(corpus_report(shard_docs(out, ("val",))).splits["val"]))
    return manifest


def fortune_files(root: Path = FORTUNES_DIR) -> list[Path]:
    """The prose fortune files: not the strfile indexes (.dat), not the .u8 links, not art."""
    if not root.is_dir():
        return []
    return sorted(
        p
        for p in root.iterdir()
        if p.is_file() and not p.is_symlink() and p.suffix not in (".dat", ".u8") and p.name not in FORTUNES_SKIP
    )


def corpus(out: str | Path, root: Path = FORTUNES_DIR, shards: int = 8, groups_per_shard: int = 4) -> dict[str, Any]:
    """The offline demo corpus: every fortune, as `shards` shards of `groups_per_shard` row groups."""
    files = fortune_files(root)
    if not files:
        raise FileNotFoundError(f"no fortune files in {root}: install them with `apt-get install fortunes`")
    docs = collect_documents(files)
    rows_per_group = math.ceil(len(docs) / (shards * groups_per_shard))
    per_shard = rows_per_group * groups_per_shard
    return write_shards(docs, out, rows_per_group, groups_per_shard, val_docs=min(per_shard, len(docs) // 2))


# -----------------------------------------------------------------------------
# Fetch (ClimbMix, nanochat's layout)


def fetch(
    num_train: int,
    out: str | Path,
    base_url: str = DEFAULT_BASE_URL,
    val_index: int = DEFAULT_VAL_INDEX,
    timeout: float = 30.0,
    retries: int = 5,
    backoff_s: float = 2.0,
) -> dict[str, Any]:
    """Shards 0..num_train-1 plus the pinned val shard (fetched last), then the manifest.

    As in nanochat, -n counts train shards and the val shard always comes too. sha256 and
    row counts are computed here: the server publishes no checksums we could check against.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    indices = [*range(min(num_train, val_index)), val_index]
    entries = []
    for index in indices:
        dest = out / shard_name(index)
        url = f"{base_url.rstrip('/')}/{dest.name}"
        if dest.exists():
            try:
                entries.append(file_entry(dest))
                print(f"{dest.name}: present, {dest.stat().st_size / 1e6:.1f} MB")
                continue
            except pa.ArrowException:
                print(f"{dest.name}: present but not valid parquet; fetching again")
                dest.unlink()
        part = part_path(dest)
        resumed = part.stat().st_size if part.exists() else 0
        t0 = time.monotonic()
        download(url, dest, timeout, retries, backoff_s)
        seconds = max(time.monotonic() - t0, 1e-6)
        entry = file_entry(dest)
        entries.append(entry)
        moved = (entry["bytes"] - resumed) / 1e6
        note = f", resumed at {resumed / 1e6:.1f} MB" if resumed else ""
        print(
            f"{dest.name}: {entry['bytes'] / 1e6:.1f} MB, {entry['rows']} rows, {moved / seconds:.1f} MB/s{note}, "
            f"sha256 {entry['sha256'][:16]}"
        )
    return write_manifest(out, entries, val_file=entries[-1]["file"])

