"""HTTP download of one file that survives flaky links: resumes with Range, retries with backoff.

`download(url, dest)` writes to `dest.part` and renames it into place only when the whole file
arrived and its parquet footer reads back, so a half-downloaded shard never looks like a shard.
The ClimbMix shard list and the manifest built from what arrived are `dataset_build.fetch`'s business.
"""

from __future__ import annotations

import http.client
import os
import re
import time
from pathlib import Path
from urllib.error import HTTPError
from urllib.request import Request, urlopen

import pyarrow as pa
import pyarrow.parquet as pq

CHUNK_BYTES = 1 << 20
USER_AGENT = "nanochat_cpu-fetch/0.1"


class ShortDownload(OSError):
    """The server closed the connection before the whole file arrived (retryable)."""


_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


def _expected_total(resp: http.client.HTTPResponse, offset: int) -> tuple[int, int | None]:
    """(offset the body starts at, total file size or None if the server did not say)."""
    if resp.status == 206:
        m = _CONTENT_RANGE.fullmatch(resp.headers.get("Content-Range", ""))
        if not m:
            raise ShortDownload(f"206 without a usable Content-Range: {resp.headers.get('Content-Range')!r}")
        start, total = int(m.group(1)), m.group(3)
        return start, None if total == "*" else int(total)
    # 200: the server ignored our Range, the body is the whole file
    length = resp.headers.get("Content-Length")
    return 0, None if length is None else int(length)


def _download_once(url: str, part: Path, timeout: float) -> None:
    """One request: append to part from where it stops, or restart it if the server won't."""
    offset = part.stat().st_size if part.exists() else 0
    headers = {"User-Agent": USER_AGENT}
    if offset:
        headers["Range"] = f"bytes={offset}-"
    try:
        resp = urlopen(Request(url, headers=headers), timeout=timeout)
    except HTTPError as e:
        # 416: nothing left after offset. Fine if the part is whole, else start over.
        if e.code == 416 and offset:
            m = re.fullmatch(r"bytes \*/(\d+)", e.headers.get("Content-Range", ""))
            if m and int(m.group(1)) == offset:
                return
            part.unlink()
            raise ShortDownload(f"server refused range from byte {offset}; restarting") from e
        raise
    with resp:
        start, total = _expected_total(resp, offset)
        if start not in (0, offset):
            raise ShortDownload(f"asked for byte {offset}, server sent from byte {start}")
        with open(part, "ab" if start else "wb") as f:
            while chunk := resp.read(CHUNK_BYTES):
                f.write(chunk)
    # http.client returns b"" (no error) when a peer closes early, so check the size here.
    size = part.stat().st_size
    if total is not None and size != total:
        raise ShortDownload(f"connection closed at byte {size} of {total}")


def part_path(dest: Path) -> Path:
    """Where download() keeps what it has of dest so far."""
    return dest.with_name(dest.name + ".part")


def download(url: str, dest: Path, timeout: float = 30.0, retries: int = 5, backoff_s: float = 2.0) -> None:
    """url -> dest via dest.part: resumes with HTTP Range, retries with exponential backoff,
    checks the parquet footer, renames into place only when whole."""
    part = part_path(dest)
    for attempt in range(1, retries + 1):
        try:
            _download_once(url, part, timeout)
            pq.read_metadata(part)  # raises unless the parquet footer arrived whole
            os.replace(part, dest)
            return
        except HTTPError as e:
            # 4xx other than 408/429 will not get better by asking again
            if 400 <= e.code < 500 and e.code not in (408, 429):
                raise RuntimeError(f"fetch {url}: HTTP {e.code} {e.reason}") from e
            error: Exception = e
        except pa.ArrowException as e:
            part.unlink(missing_ok=True)  # complete but not parquet: resuming cannot fix it
            error = e
        except (OSError, http.client.HTTPException) as e:  # URLError, timeouts, resets, ShortDownload
            error = e
        kept = part.stat().st_size if part.exists() else 0
        if attempt == retries:
            raise RuntimeError(f"fetch {url}: gave up after {retries} attempts ({kept} bytes kept in {part}): {error}")
        wait = backoff_s * 2 ** (attempt - 1)
        print(f"  {dest.name}: attempt {attempt}/{retries} failed: {error}; {kept} bytes kept, retry in {wait:.0f}s")
        time.sleep(wait)
