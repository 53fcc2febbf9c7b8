"""The run fingerprint every rank exchanges before step 0.

Two ranks that read different shards, different tokenizers or different run configs will not
crash: one runs out of data first and the other waits in all_reduce forever (docs/FAILURES.md row 1).
So before the first step each rank hashes what it will train on and the ranks compare. Any
difference stops every rank with one message naming the hosts, the file and both hashes.

Shard contents are hashed for real (not just the manifest), so a shard modified after
provisioning is caught too. Hashes are cached by (path, size, mtime) under the run's out dir
so restarts of a run on large data do not re-read every shard. A cache that cannot be read or
parsed is computed again; a disk that cannot be read or written (EIO, ENOSPC, EROFS) is the
fingerprint's `problem`, which stops every rank with exit 2 naming the host, the path and the
error: a configuration to fix, not a crash for systemd to restart in a loop.
"""

from __future__ import annotations

import errno
import json
import os
from dataclasses import dataclass

import torch

from . import __version__
from .data import sha256_file


def cached_sha256(path: str, cache: dict[str, dict]) -> str:
    st = os.stat(path)
    key = os.path.abspath(path)
    entry = cache.get(key)
    if entry and entry["size"] == st.st_size and entry["mtime_ns"] == st.st_mtime_ns:
        return entry["sha256"]
    digest = sha256_file(path)
    cache[key] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
    return digest


def data_files(data_dir: str) -> list[str]:
    """Every file the run reads from the data dir: the manifest and what it lists, and any
    parquet file lying beside them (an extra shard is a difference too)."""
    names = {"manifest.json"}
    manifest_path = os.path.join(data_dir, "manifest.json")
    if os.path.exists(manifest_path):
        with open(manifest_path) as f:
            names |= {entry["file"] for entry in json.load(f)["files"]}
    names |= {n for n in os.listdir(data_dir) if n.endswith(".parquet")}
    return sorted(names)


@dataclass
class Fingerprint:
    host: str
    files: dict[str, str]  # "data/<name>" or "tokenizer/tokenizer.json" -> sha256 ("missing" if absent)
    config: str
    versions: str
    problem: str | None = None  # this host's disk failed it: nothing else here is to be compared

    def differences(self, other: Fingerprint) -> list[str]:
        out = []
        for name in sorted(set(self.files) | set(other.files)):
            a, b = self.files.get(name, "missing"), other.files.get(name, "missing")
            if a != b:
                out.append(f"file {name}: {self.host} has {a[:16]}, {other.host} has {b[:16]}")
        if self.config != other.config:
            out.append(f"run config hash: {self.host} {self.config[:16]} vs {other.host} {other.config[:16]} "
                       f"(the trainer flags differ between the hosts' env files)")
        if self.versions != other.versions:
            out.append(f"versions: {self.host} {self.versions} vs {other.host} {other.versions}")
        return out


def read_cache(cache_path: str | None) -> dict[str, dict]:
    """The hash cache; empty (every file hashed again) where there is none or it cannot be read."""
    try:
        with open(cache_path or "") as f:
            cache = json.load(f)
    except (OSError, ValueError):
        return {}
    return cache if isinstance(cache, dict) and all(isinstance(v, dict) for v in cache.values()) else {}


def write_cache(cache_path: str, cache: dict[str, dict]) -> None:
    os.makedirs(os.path.dirname(cache_path), exist_ok=True)
    tmp = f"{cache_path}.tmp.{os.getpid()}"  # two local ranks of different nodes may share out_dir
    try:
        with open(tmp, "w") as f:
            json.dump(cache, f)
        os.replace(tmp, cache_path)
    except OSError:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def disk_problem(host: str, doing: str, exc: OSError) -> str:
    name = errno.errorcode.get(exc.errno or 0, "?")
    return (f"{host}: cannot {doing}: {exc.strerror} ({name}). Fix: look at that disk on {host} (`df -h`, `dmesg`): "
            f"free space, or remount it writable, then start the run again")


def compute(host: str, data_dir: str, tokenizer_dir: str, config_hash: str, cache_path: str | None) -> Fingerprint:
    cache = read_cache(cache_path)
    versions = f"nanochat_cpu {__version__}, torch {torch.__version__.split('+')[0]}"
    files = {}
    try:
        for name in data_files(data_dir):
            path = os.path.join(data_dir, name)
            files[f"data/{name}"] = cached_sha256(path, cache) if os.path.exists(path) else "missing"
        tok = os.path.join(tokenizer_dir, "tokenizer.json")
        files["tokenizer/tokenizer.json"] = cached_sha256(tok, cache) if os.path.exists(tok) else "missing"
    except OSError as exc:
        return Fingerprint(host, {}, config_hash, versions, disk_problem(host, f"read {exc.filename}", exc))
    if cache_path:
        try:
            write_cache(cache_path, cache)
        except OSError as exc:
            return Fingerprint(host, files, config_hash, versions,
                               disk_problem(host, f"write the hash cache {cache_path}", exc))
    return Fingerprint(host=host, files=files, config=config_hash, versions=versions)


def mismatch_report(prints: list[Fingerprint]) -> str | None:
    """One message covering every rank that differs from rank 0, or None if all agree."""
    lines = []
    for rank, fp in enumerate(prints[1:], start=1):
        diffs = prints[0].differences(fp)
        if diffs:
            lines.append(f"rank 0@{prints[0].host} vs rank {rank}@{fp.host}: " + "; ".join(diffs))
    if not lines:
        return None
    return ("run fingerprint mismatch, refusing to start (ranks would train on different inputs and "
            "one would hang in a collective): " + " | ".join(lines)
            + ". Fix: re-run site.yml so every node gets the same dataset, tokenizer and package.")
