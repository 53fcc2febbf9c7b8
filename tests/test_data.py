"""Dataset: prepare/corpus -> shards + manifest, verify, fetch over real HTTP, the token loader."""

from __future__ import annotations

import functools
import hashlib
import io
import itertools
import json
import re
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import TINY_DOCS, TINY_VAL_DOCS, english_like_docs

from nanochat_cpu import data, dataset_build
from nanochat_cpu.dataloader import TokenLoader
from nanochat_cpu.tokenizer import Tokenizer

# -----------------------------------------------------------------------------
# prepare, corpus, manifest

PLAIN = "First paragraph,\nstill the first.\n\n\nSecond paragraph.\r\n\r\nThird\n  \nFourth, after a blank-ish line.\n"
UNDERLINED = "".join(f"_\b{c}" for c in "Underlined")
BOLD = "".join(f"{c}\b{c}" for c in "Bold")
FORTUNE = f"One fortune.\n%\nTwo lines\n\t\t-- Someone\n%\n%\n{UNDERLINED} and {BOLD}\n%\n"
PLAIN_DOCS = ["First paragraph,\nstill the first.", "Second paragraph.", "Third", "Fourth, after a blank-ish line."]
FORTUNE_DOCS = ["One fortune.", "Two lines\n\t\t-- Someone", "Underlined and Bold"]


def make_sources(root: Path) -> Path:
    src = root / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text(PLAIN)
    (src / "sub" / "fortunes").write_text(FORTUNE)
    (src / "sub" / "fortunes.dat").write_bytes(b"\x00\x00\x00\x02binary index")
    (src / ".hidden").write_text("not a document")
    return src


def test_read_documents_splits_paragraphs_and_fortunes(tmp_path: Path) -> None:
    src = make_sources(tmp_path)
    assert dataset_build.read_documents(src / "a.txt") == PLAIN_DOCS
    assert dataset_build.read_documents(src / "sub" / "fortunes") == FORTUNE_DOCS
    assert dataset_build.collect_documents([src]) == PLAIN_DOCS + FORTUNE_DOCS


def test_prepare_writes_shards_and_manifest(tmp_path: Path) -> None:
    src = make_sources(tmp_path)
    extra = [f"Document number {i}." for i in range(18)]
    (src / "b.txt").write_text("\n\n".join(extra))
    expected = PLAIN_DOCS + extra + FORTUNE_DOCS  # 25 documents
    out = tmp_path / "out"
    manifest = dataset_build.prepare([src], out, rows_per_group=3, groups_per_shard=2, val_docs=4, seed=1)

    # 21 train docs in shards of 6, then the val shard; row groups of 3
    names = [f"shard_{i:05d}.parquet" for i in range(5)]
    assert json.loads((out / "manifest.json").read_text()) == manifest
    assert set(manifest) == {"format", "files", "val_file"}
    assert manifest["format"] == 1 and manifest["val_file"] == names[-1]
    assert [e["file"] for e in manifest["files"]] == names
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", *names]  # no .tmp left behind
    all_texts = []
    for entry, rows, groups in zip(manifest["files"], [6, 6, 6, 3, 4], [2, 2, 2, 1, 2], strict=True):
        path = out / entry["file"]
        meta = pq.read_metadata(path)
        assert (entry["rows"], meta.num_rows, meta.num_row_groups) == (rows, rows, groups)
        assert entry["bytes"] == path.stat().st_size
        assert entry["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
        table = pq.read_table(path)
        assert table.schema.names == ["text"] and table.schema.field("text").type == pa.string()
        all_texts += table.column("text").to_pylist()
    assert sorted(all_texts) == sorted(expected)
    assert all_texts != expected  # shuffled
    assert data.manifest_hash(out) == hashlib.sha256((out / "manifest.json").read_bytes()).hexdigest()


def test_prepare_is_deterministic_and_replaces_stale_shards(tmp_path: Path) -> None:
    docs = english_like_docs(100)
    src = tmp_path / "docs.txt"
    src.write_text("\n\n".join(docs))
    a = dataset_build.prepare([src], tmp_path / "a", rows_per_group=10, groups_per_shard=2, val_docs=10)
    b = dataset_build.prepare([src], tmp_path / "b", rows_per_group=10, groups_per_shard=2, val_docs=10)
    assert a == b and len(a["files"]) == 6
    # re-preparing into a used dir with fewer shards leaves no stale shard behind
    c = dataset_build.prepare([src], tmp_path / "a", rows_per_group=50, groups_per_shard=2, val_docs=10, seed=7)
    assert sorted(p.name for p in (tmp_path / "a").glob("*.parquet")) == ["shard_00000.parquet", "shard_00001.parquet"]
    assert c["val_file"] == "shard_00001.parquet" and c != a


def test_prepare_interrupted_leaves_no_manifest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A dir whose shards are half rewritten must fail verify, not pass with the old manifest.
    docs = english_like_docs(40)
    dataset_build.write_shards(docs, tmp_path, rows_per_group=5, groups_per_shard=2, val_docs=10)
    real_write = dataset_build._write_shard

    def write_then_die(path: Path, chunk: list[str], rows_per_group: int) -> None:
        if path.name == "shard_00001.parquet":
            raise OSError("disk full")
        real_write(path, chunk, rows_per_group)

    monkeypatch.setattr(dataset_build, "_write_shard", write_then_die)
    with pytest.raises(OSError, match="disk full"):
        dataset_build.write_shards(docs, tmp_path, rows_per_group=5, groups_per_shard=2, val_docs=10, seed=1)
    assert not (tmp_path / "manifest.json").exists()
    assert "manifest.json" in data.verify(tmp_path)[0]


def test_prepare_cli_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = make_sources(tmp_path)
    assert data.main(["prepare", "--source", str(src), "--out", str(tmp_path / "o"), "--val-docs", "2"]) == 0
    assert "2 shards, 7 documents" in capsys.readouterr().out
    assert data.main(["prepare", "--source", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    assert "no such file or directory" in capsys.readouterr().err
    assert data.main(["prepare", "--source", str(src), "--out", str(tmp_path / "o"), "--val-docs", "7"]) == 2
    assert "val docs" in capsys.readouterr().err


@pytest.mark.skipif(not dataset_build.fortune_files(), reason="Debian package `fortunes` not installed")
def test_corpus_from_fortunes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "corpus"
    assert data.main(["corpus", "--out", str(out)]) == 0
    manifest = data.read_manifest(out)
    assert len(manifest["files"]) == 8 and manifest["val_file"] == "shard_00007.parquet"
    for entry in manifest["files"]:
        assert pq.read_metadata(out / entry["file"]).num_row_groups == 4
    assert sum(e["rows"] for e in manifest["files"]) > 10_000
    texts = data.read_texts(out, ("shard_00000.parquet", 0))
    joined = " ".join(texts)
    assert "\x08" not in joined and "\n%\n" not in joined
    assert len(re.findall(r"\b(the|and|of)\b", joined)) > 100  # English prose
    assert data.verify(out) == []


def test_corpus_without_fortunes_says_how_to_install(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = data.main(["corpus", "--out", str(tmp_path / "c"), "--fortunes-dir", str(tmp_path / "missing")])
    assert rc == 2
    assert "apt-get install fortunes" in capsys.readouterr().err


# -----------------------------------------------------------------------------
# verify


@pytest.fixture
def data_copy(tiny_data_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_data_dir, tmp_path / "data"))


def test_verify_passes_on_intact_data(data_copy: Path) -> None:
    assert data.verify(data_copy) == []


def test_verify_names_modified_shard(data_copy: Path) -> None:
    path = data_copy / "shard_00002.parquet"
    expected = hashlib.sha256(path.read_bytes()).hexdigest()
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    found = hashlib.sha256(raw).hexdigest()
    assert data.verify(data_copy) == [
        f"data verify FAILED on {socket.gethostname()}: shard_00002.parquet: expected sha256 {expected}, "
        f"found {found} (fix: re-run site.yml to re-push the dataset)"
    ]


def test_verify_names_missing_shard_and_manifest(data_copy: Path) -> None:
    (data_copy / "shard_00003.parquet").unlink()
    [line] = data.verify(data_copy)
    assert ": shard_00003.parquet: expected sha256 " in line and "found no file" in line
    (data_copy / "manifest.json").unlink()
    [line] = data.verify(data_copy)
    assert "manifest.json" in line and "re-push" in line


def test_verify_cli_exit_codes(data_copy: Path) -> None:
    cmd = [sys.executable, "-m", "nanochat_cpu.data", "verify", "--data-dir", str(data_copy)]
    ok = subprocess.run(cmd, capture_output=True, text=True)
    assert ok.returncode == 0 and "data verify OK" in ok.stdout
    (data_copy / "shard_00005.parquet").write_bytes(b"truncated")
    bad = subprocess.run(cmd, capture_output=True, text=True)
    assert bad.returncode == 1
    assert f"data verify FAILED on {socket.gethostname()}: shard_00005.parquet: expected sha256" in bad.stderr


# -----------------------------------------------------------------------------
# fetch, against a real HTTP server on loopback


def parquet_bytes(docs: list[str]) -> bytes:
    buf = io.BytesIO()
    pq.write_table(pa.table({"text": docs}), buf, row_group_size=100, compression="none")
    return buf.getvalue()


class ShardServer:
    """Serves in-memory files under /data/ with Range support; can cut a response mid-body."""

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files
        self.requests: list[tuple[str, str | None]] = []
        self.cut_next: dict[str, int] = {}  # file -> how many more responses to cut short
        self.junk_next: dict[str, int] = {}  # file -> how many more responses are an HTML page
        self.honor_range = True
        self.redirect = False  # answer /data/X with a 302 to /cdn/X, as HuggingFace does
        self.redirected: list[str | None] = []  # Range headers of requests that got the 302
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                name = self.path.rsplit("/", 1)[-1]
                range_header = self.headers.get("Range")
                if server.redirect and self.path.startswith("/data/"):
                    server.redirected.append(range_header)
                    self.send_response(302)
                    self.send_header("Location", f"/cdn/{name}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                server.requests.append((name, range_header))
                body = server.files.get(name)
                if server.junk_next.get(name, 0) > 0:
                    server.junk_next[name] -= 1
                    body, range_header = b"<html>a proxy's error page, status 200</html>", None
                if body is None:
                    self.send_error(404)
                    return
                start = 0
                if range_header and server.honor_range:
                    start = int(re.fullmatch(r"bytes=(\d+)-", range_header).group(1))
                    if start >= len(body):
                        self.send_response(416)
                        self.send_header("Content-Range", f"bytes */{len(body)}")
                        self.end_headers()
                        return
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
                else:
                    self.send_response(200)
                payload = body[start:]
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                if server.cut_next.get(name, 0) > 0:
                    server.cut_next[name] -= 1
                    payload = payload[: len(payload) // 2]  # promise it all, send half, hang up
                self.wfile.write(payload)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.02,), daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/data"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


SERVED = {data.shard_name(i): parquet_bytes(english_like_docs(300, seed=i)) for i in (0, 1, 2, 9)}


@pytest.fixture
def server() -> Iterator[ShardServer]:
    srv = ShardServer(dict(SERVED))
    yield srv
    srv.close()


def fetch(server: ShardServer, out: Path, n: int = 2, retries: int = 3) -> dict:
    return dataset_build.fetch(n, out, base_url=server.url, val_index=9, timeout=5, retries=retries, backoff_s=0)


def test_fetch_downloads_train_then_val_with_checksums(server: ShardServer, tmp_path: Path) -> None:
    manifest = fetch(server, tmp_path)
    names = ["shard_00000.parquet", "shard_00001.parquet", "shard_00009.parquet"]
    assert [e["file"] for e in manifest["files"]] == names and manifest["val_file"] == names[-1]
    assert [name for name, _ in server.requests] == names
    for entry in manifest["files"]:
        served = SERVED[entry["file"]]
        assert (tmp_path / entry["file"]).read_bytes() == served
        assert entry["sha256"] == hashlib.sha256(served).hexdigest()
        assert entry["bytes"] == len(served) and entry["rows"] == 300
    assert data.read_manifest(tmp_path) == manifest and data.verify(tmp_path) == []
    assert not list(tmp_path.glob("*.part"))
    # again, one shard more: only the new one goes over the wire, val stays last
    server.requests.clear()
    manifest = fetch(server, tmp_path, n=3)
    assert server.requests == [("shard_00002.parquet", None)]
    assert [e["file"] for e in manifest["files"]] == [*names[:2], "shard_00002.parquet", names[-1]]


def test_fetch_resumes_cut_connection_with_range(server: ShardServer, tmp_path: Path) -> None:
    server.cut_next["shard_00001.parquet"] = 1
    fetch(server, tmp_path)
    half = len(SERVED["shard_00001.parquet"]) // 2
    assert [r for r in server.requests if r[0] == "shard_00001.parquet"] == [
        ("shard_00001.parquet", None),
        ("shard_00001.parquet", f"bytes={half}-"),
    ]
    assert (tmp_path / "shard_00001.parquet").read_bytes() == SERVED["shard_00001.parquet"]
    assert data.verify(tmp_path) == []


def test_fetch_resume_survives_redirect(server: ShardServer, tmp_path: Path) -> None:
    server.redirect = True
    server.cut_next["shard_00000.parquet"] = 1
    fetch(server, tmp_path, n=1)
    half = len(SERVED["shard_00000.parquet"]) // 2
    assert server.redirected == [None, f"bytes={half}-", None]
    assert server.requests == [
        ("shard_00000.parquet", None),
        ("shard_00000.parquet", f"bytes={half}-"),  # the Range header followed the redirect
        ("shard_00009.parquet", None),
    ]
    assert (tmp_path / "shard_00000.parquet").read_bytes() == SERVED["shard_00000.parquet"]


def test_fetch_restarts_when_server_ignores_range(server: ShardServer, tmp_path: Path) -> None:
    (tmp_path / "shard_00000.parquet.part").write_bytes(b"stale partial bytes")
    server.honor_range = False
    fetch(server, tmp_path, n=1)
    assert server.requests[0] == ("shard_00000.parquet", "bytes=19-")
    assert (tmp_path / "shard_00000.parquet").read_bytes() == SERVED["shard_00000.parquet"]


def test_fetch_finishes_a_complete_part_file(server: ShardServer, tmp_path: Path) -> None:
    whole = SERVED["shard_00000.parquet"]
    (tmp_path / "shard_00000.parquet.part").write_bytes(whole)  # killed after the last byte, before rename
    fetch(server, tmp_path, n=1)
    assert server.requests[0] == ("shard_00000.parquet", f"bytes={len(whole)}-")  # answered 416
    assert (tmp_path / "shard_00000.parquet").read_bytes() == whole


def test_fetch_refetches_a_whole_file_that_is_not_parquet(server: ShardServer, tmp_path: Path) -> None:
    server.junk_next["shard_00000.parquet"] = 1
    fetch(server, tmp_path, n=1)
    assert server.requests[:2] == [("shard_00000.parquet", None), ("shard_00000.parquet", None)]
    assert (tmp_path / "shard_00000.parquet").read_bytes() == SERVED["shard_00000.parquet"]


def test_fetch_gives_up_after_retries_and_keeps_part(server: ShardServer, tmp_path: Path) -> None:
    server.cut_next["shard_00000.parquet"] = 99
    with pytest.raises(RuntimeError, match=r"shard_00000.parquet: gave up after 3 attempts"):
        fetch(server, tmp_path, n=1, retries=3)
    assert len(server.requests) == 3
    assert (tmp_path / "shard_00000.parquet.part").stat().st_size > 0
    assert not (tmp_path / "shard_00000.parquet").exists() and not (tmp_path / "manifest.json").exists()


def test_fetch_404_fails_at_once(server: ShardServer, tmp_path: Path) -> None:
    del server.files["shard_00009.parquet"]
    with pytest.raises(RuntimeError, match=r"shard_00009.parquet: HTTP 404"):
        fetch(server, tmp_path, n=1)
    assert [name for name, _ in server.requests] == ["shard_00000.parquet", "shard_00009.parquet"]


def test_fetch_cli_prints_progress(server: ShardServer, tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "nanochat_cpu.data", "fetch", "-n", "1", "--out", str(tmp_path)]
    res = subprocess.run([*cmd, "--base-url", server.url, "--val-index", "9"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert re.search(r"shard_00000.parquet: [\d.]+ MB, 300 rows, [\d.]+ MB/s", res.stdout)
    assert data.read_manifest(tmp_path)["val_file"] == "shard_00009.parquet"


# -----------------------------------------------------------------------------
# the token loader


# These tests are the stream packing's (documents back to back); test_bestfit_loader.py has best-fit's.
StreamLoader = functools.partial(TokenLoader, packing="stream")


@pytest.fixture(scope="module")
def tok(tiny_tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer.load(tiny_tokenizer_dir)


def all_pairs(data_dir: Path, split: str) -> list[tuple[str, int]]:
    """(shard, row group) in manifest order, computed here from the parquet footers."""
    manifest = json.loads((data_dir / "manifest.json").read_text())
    names = [e["file"] for e in manifest["files"]]
    names = [manifest["val_file"]] if split == "val" else [n for n in names if n != manifest["val_file"]]
    return [(n, g) for n in names for g in range(pq.ParquetFile(data_dir / n).num_row_groups)]


def token_stream(data_dir: Path, tok: Tokenizer, split: str, rank: int, world_size: int) -> list[int]:
    """What rank should read: its row groups' documents in order, each behind a BOS."""
    stream: list[int] = []
    for i, (name, group) in enumerate(all_pairs(data_dir, split)):
        if i % world_size == rank:
            for text in pq.ParquetFile(data_dir / name).read_row_group(group).column("text").to_pylist():
                stream += [tok.bos_id, *tok.encode(text)]
    return stream


def take(loader: TokenLoader, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [next(loader) for _ in range(n)]


def as_rows(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    inputs, targets = batch
    return torch.cat([inputs, targets[:, -1:]], dim=1)


def test_batches_are_the_packed_bos_stream(tiny_data_dir: Path, tok: Tokenizer) -> None:
    loader = StreamLoader(tiny_data_dir, tok, "train", batch_size=4, seq_len=32)
    stream = token_stream(tiny_data_dir, tok, "train", 0, 1)
    assert stream.count(tok.bos_id) == TINY_DOCS - TINY_VAL_DOCS
    for k, (inputs, targets) in enumerate(take(loader, 5)):
        assert inputs.shape == targets.shape == (4, 32)
        assert inputs.dtype == targets.dtype == torch.long
        assert torch.equal(inputs[:, 1:], targets[:, :-1])  # targets are inputs shifted by one
        expected = torch.tensor(stream[k * 4 * 33 : (k + 1) * 4 * 33]).view(4, 33)
        assert torch.equal(as_rows((inputs, targets)), expected)
    assert loader.state_dict()["epoch"] == 0


@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
def test_ranks_split_row_groups_disjoint_and_covering(tiny_data_dir: Path, tok: Tokenizer, world_size: int) -> None:
    pairs = all_pairs(tiny_data_dir, "train")
    assert len(pairs) == 28
    seen: list[tuple[str, int]] = []
    for rank in range(world_size):
        loader = StreamLoader(tiny_data_dir, tok, "train", 2, 16, rank=rank, world_size=world_size)
        assert loader.pairs == [p for i, p in enumerate(pairs) if i % world_size == rank]
        seen += loader.pairs
        first = torch.tensor(token_stream(tiny_data_dir, tok, "train", rank, world_size)[: 2 * 17]).view(2, 17)
        assert torch.equal(as_rows(next(loader)), first)
    assert sorted(seen) == sorted(pairs) and len(seen) == len(set(seen))


@pytest.mark.parametrize("world_size", [1, 3, 4])
def test_val_is_finite_and_complete(tiny_data_dir: Path, tok: Tokenizer, world_size: int) -> None:
    rank = world_size - 1
    loader = StreamLoader(tiny_data_dir, tok, "val", 8, 64, rank=rank, world_size=world_size)
    stream = token_stream(tiny_data_dir, tok, "val", rank, world_size)
    expected = len(stream) // (8 * 65)
    batches = list(itertools.islice(loader, expected + 2))  # bounded, in case it never stops
    assert len(batches) == expected > 0
    assert torch.equal(torch.stack([as_rows(b) for b in batches]).flatten(), torch.tensor(stream[: len(batches) * 520]))
    with pytest.raises(StopIteration):
        next(loader)


def test_rank_without_row_groups_is_refused(tiny_data_dir: Path, tok: Tokenizer) -> None:
    # the val shard has 4 row groups: a 5th rank would get none and stall the others
    with pytest.raises(ValueError, match=r"val split .* has 4 row groups, too few for rank 4 of world_size 5"):
        StreamLoader(tiny_data_dir, tok, "val", 2, 16, rank=4, world_size=5)


def test_train_wraps_into_next_epoch_seamlessly(tiny_data_dir: Path, tok: Tokenizer) -> None:
    stream = token_stream(tiny_data_dir, tok, "train", 4, 5)
    n = 8 * 65
    loader = StreamLoader(tiny_data_dir, tok, "train", 8, 64, rank=4, world_size=5)
    count = 2 * len(stream) // n + 1
    got = torch.stack([as_rows(b) for b in take(loader, count)]).flatten()
    assert torch.equal(got, torch.tensor((stream * 3)[: count * n]))
    assert loader.state_dict()["epoch"] == 2


@pytest.mark.parametrize("skip", [0, 1, 7, "epoch"])
def test_resume_from_state_yields_the_same_batches(tiny_data_dir: Path, tok: Tokenizer, skip: int | str) -> None:
    args = (tiny_data_dir, tok, "train", 8, 64)
    original = StreamLoader(*args, rank=4, world_size=5)
    if skip == "epoch":  # stop right before the pass over the data ends
        skip = len(token_stream(tiny_data_dir, tok, "train", 4, 5)) // (8 * 65)
    take(original, skip)
    state = json.loads(json.dumps(original.state_dict()))
    resumed = StreamLoader(*args, rank=4, world_size=5, state=state)
    for a, b in zip(take(original, 4), take(resumed, 4), strict=True):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert resumed.state_dict() == original.state_dict()


def test_resume_val_midway_and_with_another_batch_size(tiny_data_dir: Path, tok: Tokenizer) -> None:
    original = StreamLoader(tiny_data_dir, tok, "val", 4, 32)
    take(original, 3)
    state = original.state_dict()
    rest = [as_rows(b) for b in itertools.islice(original, 1000)]
    resumed = [as_rows(b) for b in itertools.islice(StreamLoader(tiny_data_dir, tok, "val", 4, 32, state=state), 1000)]
    assert len(rest) > 0 and all(torch.equal(a, b) for a, b in zip(rest, resumed, strict=True))
    # the state is a token position, so a different batch size continues the same stream
    half = [as_rows(b) for b in take(StreamLoader(tiny_data_dir, tok, "val", 2, 32, state=state), 2)]
    assert torch.equal(torch.cat(half), rest[0])


def test_state_from_another_layout_is_refused(tiny_data_dir: Path, tok: Tokenizer) -> None:
    state = StreamLoader(tiny_data_dir, tok, "train", 2, 16, rank=1, world_size=5).state_dict()
    with pytest.raises(ValueError, match="positions do not carry over"):
        StreamLoader(tiny_data_dir, tok, "train", 2, 16, rank=1, world_size=2, state=state)
