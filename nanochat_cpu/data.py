"""The dataset on disk: parquet shards of documents and a manifest of their checksums.

A data dir is `manifest.json` + `shard_00000.parquet ...`, each shard a single `text` column
in several row groups. The manifest lists every file with its size, sha256 and row count;
the last file is the validation shard. Ranks hash the manifest before step 0 and `verify`
re-hashes the files, so two nodes can never silently train on different data (docs/FAILURES.md
row 1); `check_dataset` is the trainer's cheaper check of the same before step 0. The command
line for the whole data side is here too. Beside it: `dataset_build.py` writes data dirs
(prepare, corpus, fetch), `dataloader.py` reads shards as batches. `prepare` and `verify` print
a corpus report (`corpus_report.py`): sizes, the longest documents and their share, non-text
documents and exact duplicates, with a WARNING line for each outlier that would hurt a run (one
1.77 MB PostScript file among prose once wrecked one).

    python -m nanochat_cpu.data corpus --out DIR          # offline English: Debian `fortunes`
    python -m nanochat_cpu.data prepare --source PATH... --out DIR
        [--max-doc-chars N --long-docs {warn,crop,drop}] [--drop-binary] [--dedupe]
    python -m nanochat_cpu.data fetch -n N --out DIR      # ClimbMix shards, as nanochat
    python -m nanochat_cpu.data verify --data-dir DIR [--tokenizer-dir TOK]   # + every row group, the report
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from .corpus_report import LONG_DOC_ACTIONS, LONG_DOC_CHARS, Docs, corpus_report, report_lines
from .download import CHUNK_BYTES

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
# verify's and the trainer's check's words alike: the same fault reads the same wherever it is found
EMPTY_SHARD = "empty shard (0 rows); every shard must hold documents"


# -----------------------------------------------------------------------------
# Files and the manifest


def shard_name(index: int) -> str:
    return f"shard_{index:05d}.parquet"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()


def staging_path(path: Path) -> Path:
    """Where a file is written before os.replace puts it in place whole."""
    return path.with_name(path.name + ".tmp")


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Readers see the old file or the new one, never half of one."""
    tmp = staging_path(path)
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def file_entry(path: Path) -> dict[str, Any]:
    """One manifest row. Reading the row count also proves the parquet footer is intact."""
    rows = pq.read_metadata(path).num_rows
    return {"file": path.name, "bytes": path.stat().st_size, "sha256": sha256_file(path), "rows": rows}


def write_manifest(data_dir: Path, entries: list[dict[str, Any]], val_file: str) -> dict[str, Any]:
    names = [e["file"] for e in entries]
    if not entries or names[-1] != val_file:
        raise ValueError(f"the val file must be the last of the manifest, got {val_file!r} for {names}")
    manifest = {"format": MANIFEST_FORMAT, "files": entries, "val_file": val_file}
    write_bytes_atomic(data_dir / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())
    return manifest


def read_manifest(data_dir: str | Path) -> dict[str, Any]:
    path = Path(data_dir) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: prepare, fetch or re-push the dataset first")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != MANIFEST_FORMAT:
        raise ValueError(f"{path}: format {manifest.get('format')!r}, this code reads {MANIFEST_FORMAT}")
    return manifest


def manifest_hash(data_dir: str | Path) -> str:
    """sha256 of manifest.json's bytes: part of the run fingerprint every rank compares."""
    return sha256_file(Path(data_dir) / MANIFEST)


def split_files(manifest: dict[str, Any], split: str) -> list[str]:
    """Shard names of a split, in manifest order: val is the val_file, train all the others."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    names = [e["file"] for e in manifest["files"]]
    if split == "val":
        return [manifest["val_file"]]
    return [n for n in names if n != manifest["val_file"]]


def row_group_pairs(data_dir: str | Path, split: str) -> list[tuple[str, int]]:
    """Every (shard, row group) of a split, flat and in order: the unit ranks share out."""
    pairs = []
    for name in split_files(read_manifest(data_dir), split):
        num_groups = pq.read_metadata(Path(data_dir) / name).num_row_groups
        pairs.extend((name, i) for i in range(num_groups))
    return pairs


def read_texts(data_dir: str | Path, pair: tuple[str, int]) -> list[str]:
    name, group = pair
    table = pq.ParquetFile(Path(data_dir) / name).read_row_group(group, columns=["text"])
    return table.column("text").to_pylist()


def iter_texts(data_dir: str | Path, split: str) -> Iterator[list[str]]:
    """The documents of a split, one list per row group."""
    for pair in row_group_pairs(data_dir, split):
        yield read_texts(data_dir, pair)


def shard_docs(data_dir: str | Path, splits: Sequence[str] = ("train", "val")) -> Iterator[Docs]:
    """Every row group of the splits, each document named by shard, row group and row."""
    for split in splits:
        for name, group in row_group_pairs(data_dir, split):
            texts = read_texts(data_dir, (name, group))
            yield Docs(split, name, [f"{name} row group {group} row {row}" for row in range(len(texts))], texts)


# -----------------------------------------------------------------------------
# Verify


def _is_text(kind: pa.DataType) -> bool:
    """Strings in any of the layouts a parquet writer picks (polars writes views, pandas may
    dictionary-encode): the loader reads each as Python strings."""
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    return pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)


def schema_problem(schema: pa.Schema) -> str | None:
    """A shard has a `text` column of strings: what the loader and the tokenizer read (other
    columns, an id or a url, are left alone)."""
    if schema.get_field_index("text") < 0:
        return f"no 'text' column (columns {schema.names}): the loader reads documents from 'text'"
    kind = schema.field("text").type
    if not _is_text(kind):
        return f"column 'text' is {kind}, expected string"
    return None


def shard_problem(path: Path) -> str | None:
    """Read every row group, not only the footer: a corrupt page shows only when it is decoded."""
    # The footer's problems in check_dataset's words: the same fault reads the same in preflight and trainer.
    try:
        shard = pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a bad footer
        return f"not a readable parquet file ({type(e).__name__}: {e})"
    if (problem := schema_problem(shard.schema_arrow)) is not None:
        return problem
    if shard.metadata.num_rows == 0:
        return EMPTY_SHARD
    try:
        for group in range(shard.num_row_groups):
            where = f"row group {group}"
            column = shard.read_row_group(group, columns=["text"]).column("text")
            column.validate(full=True)  # bytes flipped inside a string are invalid UTF-8, found here
            if column.null_count:
                return f"{where}: {column.null_count} null document(s)"
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a bad page
        return f"{where}: unreadable ({type(e).__name__}: {e})"
    return None


def verify(data_dir: str | Path) -> list[str]:
    """Re-hash every file against the manifest, then read every shard whose hash matches (schema,
    every row group); one line per problem, empty when all is well."""
    data_dir = Path(data_dir)
    host = socket.gethostname()
    fix = "(fix: re-run site.yml to re-push the dataset)"
    # The file is what the manifest says: pushing it again cannot help, writing it again can.
    rebuild = "(fix: prepare, corpus or fetch the dataset again on the controller, then re-run site.yml)"
    try:
        manifest = read_manifest(data_dir)
    except (OSError, ValueError) as e:
        return [f"data verify FAILED on {host}: {MANIFEST}: {e} {fix}"]
    problems = []
    for entry in manifest["files"]:
        path = data_dir / entry["file"]
        found = sha256_file(path) if path.is_file() else "no file"
        if found != entry["sha256"]:
            problems.append(
                f"data verify FAILED on {host}: {entry['file']}: expected sha256 {entry['sha256']}, found {found} {fix}"
            )
        elif (problem := shard_problem(path)) is not None:
            problems.append(f"data verify FAILED on {host}: {entry['file']}: {problem} {rebuild}")
    return problems


def check_dataset(data_dir: str | Path, world_size: int, digests: dict[str, str] | None = None) -> list[str]:
    """What would make a run fail later, found before step 0; one line per problem, each with the fix.

    Only facts that are the same on every rank are used (the ranks have already agreed on the
    files' hashes), so every rank reaches the same verdict and can exit without a collective:
    the manifest is readable; each file matches its manifest sha256 (`digests`: name -> sha256,
    already computed for the fingerprint) and is a readable parquet file with rows whose footer's
    schema is one `text` column of strings (`verify` reads the pages too: too slow here); each split
    has at least one row group per rank.
    """
    data_dir = Path(data_dir)
    fix = "fix: re-run site.yml to push the dataset again, or re-prepare it"
    try:
        manifest = read_manifest(data_dir)
        entries = [(e["file"], e["sha256"], e.get("rows")) for e in manifest["files"]]
        val_file = manifest["val_file"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return [f"{data_dir / MANIFEST}: unreadable ({type(e).__name__}: {e}); {fix}"]
    problems, groups = [], {}
    for name, sha, rows in entries:
        path = data_dir / name
        if not path.is_file():
            problems.append(f"{path}: listed in {MANIFEST} but missing; {fix}")
            continue
        found = (digests or {}).get(name)
        if found is not None and found != sha:
            problems.append(f"{path}: sha256 {found[:16]} does not match {MANIFEST} ({sha[:16]}): the file "
                            f"changed after the dataset was written; {fix}")
            continue
        try:
            meta = pq.read_metadata(path)
        except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a bad footer
            problems.append(f"{path}: not a readable parquet file ({type(e).__name__}: {e}); {fix}")
            continue
        if (bad_schema := schema_problem(meta.schema.to_arrow_schema())) is not None:  # the footer's: cheap
            problems.append(f"{path}: {bad_schema}; {fix}")
        elif meta.num_rows == 0:
            problems.append(f"{path}: {EMPTY_SHARD}; {fix}")
        elif rows is not None and meta.num_rows != rows:
            problems.append(f"{path}: {meta.num_rows} rows, {MANIFEST} says {rows}; {fix}")
        groups[name] = meta.num_row_groups
    if problems:
        return problems
    for split in ("train", "val"):
        have = sum(groups[n] for n in split_files(manifest, split))
        if have < world_size:
            files = val_file if split == "val" else f"{len(entries) - 1} train shard(s)"
            problems.append(f"{data_dir}: the {split} split ({files}) has {have} row group(s), fewer than the "
                            f"{world_size} ranks (each rank reads whole row groups): re-prepare it with a "
                            f"smaller --rows-per-group or more documents")
    return problems


# -----------------------------------------------------------------------------
# Command line


def main(argv: Sequence[str] | None = None) -> int:
    # Imported here: dataset_build imports the on-disk format from this module, so at the top it would be a cycle.
    from .dataset_build import DEFAULT_BASE_URL, DEFAULT_VAL_INDEX, FORTUNES_DIR, corpus, fetch, prepare

    parser = argparse.ArgumentParser(prog="python -m nanochat_cpu.data", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("prepare", help="text files or dirs -> parquet shards + manifest")
    p.add_argument("--source", nargs="+", required=True, type=Path, help="text files or directories")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--rows-per-group", type=int, default=1024)
    p.add_argument("--groups-per-shard", type=int, default=4)
    p.add_argument("--val-docs", type=int, default=None, help="documents in the val shard (default: one shard)")
    p.add_argument("--seed", type=int, default=0, help="shuffle seed")
    p.add_argument("--max-doc-chars", type=int, default=LONG_DOC_CHARS,
                   help=f"longer documents are flagged, or cropped/dropped by --long-docs (default {LONG_DOC_CHARS:,})")
    p.add_argument("--long-docs", choices=LONG_DOC_ACTIONS, default="warn",
                   help="what to do with documents over --max-doc-chars (default: warn)")
    p.add_argument("--drop-binary", action="store_true", help="drop documents that look binary or non-text")
    p.add_argument("--dedupe", action="store_true", help="keep only the first of exact duplicate documents")

    p = sub.add_parser("corpus", help="the offline English demo corpus from Debian's `fortunes`")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--fortunes-dir", type=Path, default=FORTUNES_DIR, help=argparse.SUPPRESS)

    p = sub.add_parser("fetch", help="download ClimbMix shards (train 0..N-1 + the val shard)")
    p.add_argument("-n", "--num-files", type=int, required=True, help="number of train shards")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--base-url", default=DEFAULT_BASE_URL)
    p.add_argument("--val-index", type=int, default=DEFAULT_VAL_INDEX, help="index of the pinned val shard")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds per socket operation")
    p.add_argument("--retries", type=int, default=5)

    p = sub.add_parser("verify", help="re-hash every file against manifest.json, read every row group, report")
    p.add_argument("--data-dir", required=True, type=Path)
    p.add_argument("--tokenizer-dir", type=Path, default=None, help="count tokens per shard with this tokenizer")
    p.add_argument("--no-report", dest="report", action="store_false",
                   help="check only (each node's preflight: the controller has shown the report once)")
    p.add_argument("--max-doc-chars", type=int, default=LONG_DOC_CHARS,
                   help=f"the report's cap on a document's length, as prepare's (default {LONG_DOC_CHARS:,})")
    p.add_argument("--report-file", type=Path, default=None, help="also write the report there")

    args = parser.parse_args(argv)
    try:
        if args.cmd == "prepare":
            m = prepare(args.source, args.out, args.rows_per_group, args.groups_per_shard, args.val_docs, args.seed,
                        args.max_doc_chars, args.long_docs, args.drop_binary, args.dedupe)
        elif args.cmd == "corpus":
            m = corpus(args.out, root=args.fortunes_dir)
        elif args.cmd == "fetch":
            m = fetch(args.num_files, args.out, args.base_url, args.val_index, args.timeout, args.retries)
        else:
            return _verify_cli(args.data_dir, args.tokenizer_dir, args.report, args.max_doc_chars, args.report_file)
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        print(f"data {args.cmd}: {e}", file=sys.stderr)
        return 2
    rows = sum(e["rows"] for e in m["files"])
    size = sum(e["bytes"] for e in m["files"])
    print(f"{args.out}: {len(m['files'])} shards, {rows} documents, {size / 1e6:.1f} MB, val_file {m['val_file']}")
    return 0


def _verify_cli(data_dir: Path, tokenizer_dir: Path | None, report: bool, max_doc_chars: int,
                report_file: Path | None) -> int:
    problems = verify(data_dir)
    for line in problems:
        print(line, file=sys.stderr)
    if problems:
        return 1
    m = read_manifest(data_dir)
    size = sum(e["bytes"] for e in m["files"])
    print(
        f"data verify OK on {socket.gethostname()}: {len(m['files'])} files, {size / 1e6:.1f} MB, "
        f"manifest sha256 {manifest_hash(data_dir)}"
    )
    if report:
        text = "\n".join(report_lines(corpus_report(shard_docs(data_dir), tokenizer_dir, max_doc_chars))) + "\n"
        print(text, end="")
        if report_file is not None:  # the dataset role shows it from there until the manifest changes
            report_file.parent.mkdir(parents=True, exist_ok=True)
            write_bytes_atomic(report_file, text.encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
