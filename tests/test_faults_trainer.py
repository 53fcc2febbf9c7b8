"""Faults injected into the trainer on real torchrun + Gloo processes on loopback.

Each test breaks one thing a real cluster breaks — a checkpoint write cut short by SIGKILL or a
full disk, a bad flag, an empty or corrupt shard, a tokenizer from another corpus, a foreign
process on the master port — and asserts what the operator sees: one clear line naming the
value and the fix, a non-zero exit on every rank within seconds (no rank left waiting in a
collective), and the existing checkpoints unchanged. The container-cluster cases (node loss,
data drift after site.yml, network misconfiguration) are molecule/faults.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from nanochat_cpu import checkpoint_files, config, data, dataset_build, tokenizer
from nanochat_cpu.compile_choice import resolve_compile
from tests.trainer_runs import (
    ENTRY_POINTS,
    REPO,
    SLOW_CHECKPOINT_TRAIN,
    descendants,
    finish,
    free_port,
    kill_tree,
    losses,
    node_env,
    read_until,
    run_torchrun,
    spawn_node,
    tiny_flags,
    torchrun_cmd,
    train_target,
)

FAULT_TRAIN = str(ENTRY_POINTS / "fault_train.py")
# Two cold torch imports per node on a loaded 2-core machine, plus the failure itself.
FAIL_FAST_S = 30


def tree_digest(root: Path) -> dict[str, str]:
    """sha256 of every file under root: 'untouched' means this is unchanged."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def trainer_traceback(out: str) -> bool:
    """A Python traceback through our code (torchrun's own ChildFailedError report is expected)."""
    return re.search(r'File ".*nanochat_cpu/\w+\.py", line', out) is not None


def rewrite_manifest_entry(data_dir: Path, name: str) -> None:
    """Make manifest.json describe `name` as it is now (so only the content itself is bad)."""
    manifest = json.loads((data_dir / "manifest.json").read_text())
    raw = (data_dir / name).read_bytes()
    for entry in manifest["files"]:
        if entry["file"] == name:
            entry.update(bytes=len(raw), sha256=hashlib.sha256(raw).hexdigest())
            try:
                entry["rows"] = pq.read_metadata(data_dir / name).num_rows
            except Exception:  # noqa: BLE001 - garbage has no row count; keep the old one
                pass
    (data_dir / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")


def write_empty_shard(path: Path) -> None:
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), path)



def bad_shards_copy(data_dir: Path, dest: Path) -> Path:
    """A copy of the dataset with shard 1 empty and shard 2 garbage, the manifest agreeing (so only
    the contents are bad: what site.yml pushes from a bad `prepare`)."""
    shutil.copytree(data_dir, dest)
    write_empty_shard(dest / "shard_00001.parquet")
    (dest / "shard_00002.parquet").write_bytes(os.urandom(4096))
    for name in ("shard_00001.parquet", "shard_00002.parquet"):
        rewrite_manifest_entry(dest, name)
    return dest

@pytest.fixture(scope="module")
def trained_run(tiny_data_dir, tiny_tokenizer_dir, tmp_path_factory) -> tuple[Path, str]:
    """A finished 2-rank run with complete checkpoints at steps 4, 8 and 12, and its output."""
    out = tmp_path_factory.mktemp("trained") / "run"
    proc = run_torchrun(2, train_target(*tiny_flags(tiny_data_dir, tiny_tokenizer_dir, out)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert checkpoint_files.complete_steps(str(out)) == [4, 8, 12]
    return out, proc.stdout


def copy_run(trained_run, dest: Path) -> tuple[Path, dict[str, str]]:
    shutil.copytree(trained_run[0], dest)
    return dest, tree_digest(dest / "checkpoints")


def two_nodes_fail(flags_per_node: list[list[str]], code: int, timeout: float = 90) -> list[str]:
    """Two 'nodes' (one launcher each): both must exit with `code` on their own, within FAIL_FAST_S.
    The code is what systemd sees: 2 and 3 are in the unit's RestartPreventExitStatus."""
    port = free_port()
    t0 = time.monotonic()
    nodes = [spawn_node(2, rank, port, train_target(*flags)) for rank, flags in enumerate(flags_per_node)]
    results = [finish(p, timeout=timeout) for p in nodes]
    took = time.monotonic() - t0
    for got, out, _ in results:
        assert got == code, f"exit {got}, expected {code}:\n{out}"
        assert "FATAL" in out and not trainer_traceback(out), out
    assert took < FAIL_FAST_S, f"ranks took {took:.0f}s to give up:\n" + results[0][1]
    return [out for _, out, _ in results]


# ---- checkpoints cut short ---------------------------------------------------------------------

def test_sigkill_mid_checkpoint_write_keeps_previous_and_resume_reaches_the_end(tiny_data_dir, tiny_tokenizer_dir,
                                                                                tmp_path):
    out = tmp_path / "run"
    flags = tiny_flags(tiny_data_dir, tiny_tokenizer_dir, out)
    env = node_env()
    env.update(FAULT_RANK="0", FAULT_STEP="8", FAULT_FILE="model.pt", FAULT_MODE="kill")
    killed = subprocess.run(torchrun_cmd(2, free_port(), [FAULT_TRAIN, *flags]), env=env, capture_output=True,
                            text=True, timeout=240, cwd=REPO)
    assert killed.returncode != 0 and "FAULT: SIGKILL while writing" in killed.stdout, killed.stdout
    before = losses(killed.stdout)
    assert max(before) == 8  # steps 1..8 ran; the kill came while step 8's checkpoint was written

    # what the kill left: step 4 sealed, step 8 half-written (a partial temp file, no COMPLETE)
    ck = out / "checkpoints"
    assert checkpoint_files.complete_steps(str(out)) == [4]
    partial = [p.name for p in (ck / "step_000008").iterdir()]
    assert "COMPLETE" not in partial and any(n.startswith("model.pt.tmp.") for n in partial), partial
    # a second, hand-made wreck newer than anything: truncated model.pt, no marker
    wreck = ck / "step_000010"
    wreck.mkdir()
    (wreck / "model.pt").write_bytes((ck / "step_000004" / "model.pt").read_bytes()[:1000])
    (wreck / "rank0.pt.tmp.999").write_bytes(b"\0" * 100)
    for name in ("model.pt", "rank0.pt", "rank1.pt"):  # the previous checkpoint loads
        torch.load(ck / "step_000004" / name, weights_only=False)

    resumed = run_torchrun(2, train_target(*flags))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resumed from checkpoint step 4" in resumed.stdout
    after = losses(resumed.stdout)
    assert sorted(after) == list(range(5, 13))
    for step in range(5, 9):  # step 4's checkpoint reproduces what the killed run computed next
        assert after[step] == pytest.approx(before[step], abs=1e-4), (step, after[step], before[step])
    assert checkpoint_files.complete_steps(str(out)) == [4, 8, 12]
    assert not wreck.exists()  # stale wrecks older than the newest complete checkpoint are pruned


def test_disk_full_during_checkpoint_names_the_cause_and_keeps_previous(tiny_data_dir, tiny_tokenizer_dir, tmp_path):
    out = tmp_path / "run"
    env = node_env()
    env.update(FAULT_RANK="0", FAULT_STEP="8", FAULT_FILE="rank0.pt", FAULT_MODE="enospc")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, FAULT_TRAIN, *tiny_flags(tiny_data_dir, tiny_tokenizer_dir, out)],
                          env=env, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == config_exit(), proc.stdout + proc.stderr
    assert time.monotonic() - t0 < FAIL_FAST_S
    assert not trainer_traceback(proc.stderr), proc.stderr
    assert "FATAL: cannot write checkpoint step 8 under" in proc.stdout
    assert "No space left on device" in proc.stdout and "newest complete: 4" in proc.stdout
    assert "free space on" in proc.stdout
    assert checkpoint_files.complete_steps(str(out)) == [4]
    # the partial temp file was removed (its space given back); step 4 is whole
    assert not [p for p in (out / "checkpoints" / "step_000008").iterdir() if ".tmp." in p.name]
    torch.load(out / "checkpoints" / "step_000004" / "model.pt", weights_only=True)




@pytest.mark.skipif(os.getuid() != 0, reason="mounts a 1 MiB tmpfs")
def test_a_really_full_disk_is_named_not_reported_as_a_zip_error(tmp_path):
    """torch.save itself reports ENOSPC as 'enforce fail ... unexpected pos'; the operator must
    read 'No space left on device', and the partial file must be gone."""
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "faults-test", str(small)], check=True)
    try:
        with pytest.raises(OSError, match="No space left on device"):
            checkpoint_files.atomic_torch_save({"w": torch.zeros(1 << 20)}, str(small / "model.pt"))
        assert list(small.iterdir()) == []
        checkpoint_files.atomic_torch_save({"w": torch.arange(4)}, str(small / "model.pt"))  # fits: written whole
        assert torch.equal(torch.load(small / "model.pt")["w"], torch.arange(4))
    finally:
        subprocess.run(["umount", str(small)], check=True)

@pytest.mark.skipif(os.getuid() != 0, reason="mounts a 1 MiB tmpfs")
def test_a_full_disk_at_start_stops_the_run_once_naming_host_path_and_error(tiny_data_dir, tiny_tokenizer_dir,
                                                                            tmp_path):
    """The run directory's disk is full before step 0 (its hash cache cannot be written): every rank
    exits 2, which the unit does not restart, naming the host, the file and ENOSPC; a corrupt hash
    cache on a healthy disk is computed again."""
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "faults-test", str(small)], check=True)
    try:
        with contextlib.suppress(OSError), open(small / "filler", "wb") as f:
            while True:
                f.write(b"\0" * 65536)
        proc = run_torchrun(2, train_target(*tiny_flags(tiny_data_dir, tiny_tokenizer_dir, small)))
        said = proc.stdout + proc.stderr
        assert proc.returncode == 2, said
        assert re.search(rf"FATAL: a disk failed before step 0: {re.escape(socket.gethostname())}: cannot write the "
                         rf"hash cache {re.escape(str(small))}/\.hash-cache\.json: No space left on device "
                         rf"\(ENOSPC\)", said), said
        assert not trainer_traceback(said) and not losses(proc.stdout)
    finally:
        subprocess.run(["umount", str(small)], check=True)
    out = tmp_path / "run"
    out.mkdir()
    (out / ".hash-cache.json").write_text('{"cut short')
    proc = run_torchrun(1, train_target(*tiny_flags(tiny_data_dir, tiny_tokenizer_dir, out, num_iterations=2)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads((out / ".hash-cache.json").read_text())  # written again, whole


def test_disk_full_on_one_node_stops_every_rank_naming_it(tiny_data_dir, tiny_tokenizer_dir, tmp_path):
    """Rank 1's node runs out of space at step 8: both ranks exit 2 (no restart loop) naming rank 1,
    instead of rank 0 timing out in the next collective and being restarted without it."""
    port = free_port()
    nodes = []
    for rank in range(2):
        env = node_env()
        env.update(FAULT_RANK="1", FAULT_STEP="8", FAULT_FILE="rank1.pt", FAULT_MODE="enospc")
        nodes.append(spawn_node(2, rank, port, [FAULT_TRAIN, *tiny_flags(tiny_data_dir, tiny_tokenizer_dir,
                                                                          tmp_path / f"node{rank}")], env=env))
    t0 = time.monotonic()
    results = [finish(p, timeout=180) for p in nodes]
    for rank, (code, out, _) in enumerate(results):
        assert code == config_exit(), out
        assert "FATAL: rank 1@" in out and "cannot write checkpoint step 8" in out, out
        assert "No space left on device" in out and "newest complete: 4" in out, out
        assert checkpoint_files.complete_steps(str(tmp_path / f"node{rank}")) == [4]
    assert time.monotonic() - t0 < 120

def test_disk_full_while_a_checkpoint_crosses_in_the_background_stops_every_rank_naming_it(tiny_data_dir,
                                                                                          tiny_tokenizer_dir,
                                                                                          tmp_path):
    """With local steps checkpoint 8 is written by a thread of each rank while the inner steps go on.
    Rank 1's disk fills up during it: every rank still exits 2 naming rank 1 and its disk, not 4 as
    for a peer lost (the loop's own collectives meet rank 1's exit), and nothing is sealed past 4."""
    port = free_port()
    env = {**node_env(), "FAULT_RANK": "1", "FAULT_STEP": "8", "FAULT_FILE": "rank1.pt", "FAULT_MODE": "enospc"}
    nodes = [spawn_node(2, rank, port, [FAULT_TRAIN, *tiny_flags(
        tiny_data_dir, tiny_tokenizer_dir, tmp_path / f"node{rank}", sync_every=2, sync_warmup_ratio=0,
        num_iterations=40)], env=env) for rank in range(2)]
    results = [finish(p, timeout=180) for p in nodes]
    for rank, (code, out, _) in enumerate(results):
        assert "checkpoint step 8 taken: it reaches every disk in the background" in out, out
        assert code == config_exit(), out
        assert "FATAL: rank 1@" in out and "cannot write checkpoint step 8" in out, out
        assert "No space left on device" in out and "newest complete: 4" in out, out
        assert checkpoint_files.complete_steps(str(tmp_path / f"node{rank}")) == [4]


def test_a_disk_that_stops_answering_in_a_checkpoint_is_named_within_the_watchdogs_bound(tiny_data_dir,
                                                                                        tiny_tokenizer_dir,
                                                                                        tmp_path):
    """Rank 1's write of checkpoint 8 never returns (a dying disk, a hung network mount: no error,
    no timeout of the write's own). Its watchdog names the write, the host and what to look at
    once --collective-timeout 5 + 30 s have passed, and exits 4 (the unit restarts and resumes);
    rank 0, waiting for rank 1's verdict on its write, exits too. Nothing past 4 is sealed."""
    env = {**node_env(), "FAULT_RANK": "1", "FAULT_STEP": "8", "FAULT_FILE": "rank1.pt", "FAULT_MODE": "hang"}
    targets = [[FAULT_TRAIN, *tiny_flags(tiny_data_dir, tiny_tokenizer_dir, tmp_path / f"node{rank}",
                                         collective_timeout=5)] for rank in range(2)]
    out0, out1 = both_stop_at_the_watchdogs_bound(
        targets, env, "FAULT: the disk stops answering",
        r"writing checkpoint step 8 to \S+step_000008 at step 8 on \S+: no byte reached the disk in that time")
    assert "rank 1@" in out0, out0
    for rank in range(2):
        assert checkpoint_files.complete_steps(str(tmp_path / f"node{rank}")) == [4]


def test_a_shard_read_that_never_returns_is_named_within_the_watchdogs_bound(tiny_data_dir, tiny_tokenizer_dir,
                                                                             tmp_path):
    """Rank 1's fourth read of a row group blocks for good (a dying disk, a hung network mount):
    its watchdog names the file, the host and what to look at once --collective-timeout 5 + 30 s
    have passed, and exits 4 (the unit restarts and resumes); rank 0, waiting in the next
    collective, exits too. Before, the read hung the rank with its unit active."""
    env = {**node_env(), "STALL_RANK": "1", "STALL_AFTER": "3"}
    target = [str(ENTRY_POINTS / "stalled_read_train.py"),
              *tiny_flags(tiny_data_dir, tiny_tokenizer_dir, tmp_path, collective_timeout=5, num_iterations=200)]
    both_stop_at_the_watchdogs_bound([target, target], env, "FAULT: the read of",
                                     r"reading \S+/shard_\d+\.parquet \(row group \d+\) on \S+: "
                                     r"no byte came from the disk in that time")


def both_stop_at_the_watchdogs_bound(targets: list[list[str]], env: dict, fault: str, stall: str) -> tuple[str, str]:
    """Two ranks, rank 1's disk stops answering (`fault` says when): rank 1's watchdog says `stall`
    at --collective-timeout 5 + 30 s with the fix and exits 4, and rank 0 exits 4 naming a FATAL
    of its own. Returns both ranks' output."""
    port = free_port()
    nodes = [spawn_node(2, rank, port, target, env=env) for rank, target in enumerate(targets)]
    t0 = time.monotonic()
    (code0, out0, _), (code1, out1, _) = [finish(p, timeout=180) for p in nodes]
    assert time.monotonic() - t0 < 120
    assert fault in out1, out1
    stalled = re.search(rf"FATAL: stuck (\d+)s \(bound 35s, --collective-timeout\) {stall}, it does not answer\. "
                        r"Fix: look at the disk under", out1)
    assert stalled and int(stalled.group(1)) >= 35 and code1 == collective_exit(), out1
    assert code0 == collective_exit() and "FATAL" in out0, out0
    return out0, out1


def test_a_one_process_watchdog_bounds_a_stalled_write_not_a_slow_one(tmp_path):
    """Without peers the watchdog still runs: a run on one node whose disk stops answering says
    so and exits rather than hang with its unit active. The bound is on the time without progress:
    a write that goes on reaching the disk (a big checkpoint on an SD card) takes as long as it
    takes. A one-process run's other phases (a compile on a slow laptop) wait on no peer and are
    not bounded."""
    script = ("import time\n"
              "from nanochat_cpu.dist import DistEnv, Watchdog\n"
              "dog = Watchdog(DistEnv(rank=0, local_rank=0, world_size=1), 1.0)\n"
              "with dog.phase('--compile auto: compiling', 2):\n"
              "    time.sleep(3)\n"
              "with dog.disk('writing checkpoint step 2 to /x', 2, 'Fix: none needed.') as progress:\n"
              "    for _ in range(6):\n"
              "        time.sleep(0.5)\n"
              "        progress()\n"
              "print('compiled and written', flush=True)\n"
              "with dog.disk('writing checkpoint step 3 to /x', 3, 'Fix: look at the disk.'):\n"
              "    time.sleep(60)\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30, cwd=REPO)
    assert proc.returncode == collective_exit() and "compiled and written" in proc.stdout, proc.stdout + proc.stderr
    assert re.search(r"FATAL: stuck \d+s \(bound 1s, --collective-timeout\) writing checkpoint step 3 to /x at "
                     r"step 3 on \S+: no byte reached the disk in that time, it does not answer\. Fix: look at the "
                     r"disk\.", proc.stdout), proc.stdout


def test_a_background_threads_stall_is_seen_while_the_loop_marks_phases_of_its_own(tmp_path):
    """A checkpoint crossing in the background stalls on its thread while the loop goes on marking
    short phases of its own (the loader's reads, every micro-step). Each thread's phase is watched:
    the loop's phases ending must not erase the background's (one slot for both did, and a rank
    waited for a dead peer for ever)."""
    script = ("import threading, time\n"
              "from nanochat_cpu.dist import DistEnv, Watchdog\n"
              "dog = Watchdog(DistEnv(rank=0, local_rank=0, world_size=1), 1.0)\n"
              "def background():\n"
              "    time.sleep(0.05)\n"
              "    with dog.disk('writing checkpoint step 8 to /x', 8, 'Fix: look at the disk.'):\n"
              "        time.sleep(30)\n"
              "threading.Thread(target=background, daemon=True).start()\n"
              "end = time.time() + 8\n"
              "while time.time() < end:\n"
              "    with dog.disk('reading shard_00000.parquet', -1, 'Fix: none needed.') as progress:\n"
              "        time.sleep(0.1)\n"
              "        progress()\n"
              "print('the loop went on', flush=True)\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30, cwd=REPO)
    assert proc.returncode == collective_exit() and "the loop went on" not in proc.stdout, proc.stdout + proc.stderr
    assert re.search(r"FATAL: stuck \d+s \(bound 1s, --collective-timeout\) writing checkpoint step 8 to /x at step 8",
                     proc.stdout), proc.stdout


def test_a_checkpoint_file_reaches_the_disk_in_pieces_each_a_sign_of_progress(tmp_path, monkeypatch):
    """A big file is pushed to the disk (fdatasync) every SYNC_BYTES, and each piece counts as
    progress for the watchdog; the file lands whole, through either writer."""
    monkeypatch.setattr(checkpoint_files, "SYNC_BYTES", 4096)
    seen = []
    data = os.urandom(10 * 4096 + 123)
    checkpoint_files.atomic_write_bytes(str(tmp_path / "rank0.pt"), data, lambda: seen.append("bytes"))
    assert (tmp_path / "rank0.pt").read_bytes() == data and len(seen) == 10
    weights = {"w": torch.randn(64, 64)}
    checkpoint_files.atomic_torch_save(weights, str(tmp_path / "model.pt"), lambda: seen.append("torch"))
    assert torch.equal(torch.load(tmp_path / "model.pt")["w"], weights["w"]) and seen.count("torch") >= 4


def test_a_checkpoint_that_takes_longer_than_the_collective_timeout_to_cross_still_lands(tiny_data_dir,
                                                                                          tiny_tokenizer_dir,
                                                                                          tmp_path):
    """On a slow link a big model's checkpoint takes minutes to reach every disk (10 Mbit/s, depth 8:
    461 s of the default 600-s --collective-timeout). Here two nodes' states cross in rounds of
    8 KiB, each 0.6 s slower than loopback: about 45 s in all, past the watchdog's bound of
    --collective-timeout 5 + its 30-s grace. Each round is a collective of its own, timed on its
    own, so the checkpoint lands on both disks and the run ends well, where one collective for the
    whole exchange would have been given up on as a dead peer at every checkpoint."""
    port = free_port()
    env = {**node_env(), "CHUNK_BYTES": "8192", "ROUND_S": "0.6"}
    def flags(rank: int) -> list[str]:
        return [SLOW_CHECKPOINT_TRAIN, *tiny_flags(tiny_data_dir, tiny_tokenizer_dir, tmp_path / f"node{rank}",
                                                   num_iterations=2, checkpoint_every=0, collective_timeout=5)]

    nodes = [spawn_node(2, rank, port, flags(rank), env=env) for rank in range(2)]
    results = [finish(p, timeout=240) for p in nodes]
    for rank, (code, out, _) in enumerate(results):
        assert code == 0, out
        saved = re.search(r"checkpoint step 2 saved to \S+ in ([0-9.]+)s; [0-9.]+ MiB of 2 ranks' states in (\d+) "
                          r"round\(s\)", out)
        assert saved and float(saved.group(1)) > 5 + 30 and int(saved.group(2)) >= 60, out
        assert checkpoint_files.complete_steps(str(tmp_path / f"node{rank}")) == [2]
        assert "stuck" not in out and "FATAL" not in out, out


def config_exit() -> int:
    from nanochat_cpu.dist import EXIT_CONFIG
    return EXIT_CONFIG


def collective_exit() -> int:
    from nanochat_cpu.dist import EXIT_COLLECTIVE
    return EXIT_COLLECTIVE


def mismatch_exit() -> int:
    from nanochat_cpu.dist import EXIT_MISMATCH
    return EXIT_MISMATCH


def test_silent_peer_is_given_up_on_after_the_collective_timeout(tiny_data_dir, tiny_tokenizer_dir, tmp_path):
    """A peer that stops answering without closing its sockets (hung, asleep, cable pulled):
    no connection reset tells the others, so --collective-timeout bounds the wait."""
    port = free_port()
    flags = tiny_flags(tiny_data_dir, tiny_tokenizer_dir, tmp_path, num_iterations=100000, checkpoint_every=0,
                       collective_timeout=5)
    nodes = [spawn_node(2, rank, port, train_target(*flags)) for rank in range(2)]
    try:
        read_until(nodes[0], "step 00003", timeout=90)
        for pid in descendants(nodes[1].pid):  # freeze node 1's trainer: alive, sockets open, silent
            os.kill(pid, signal.SIGSTOP)
        code, out, waited = finish(nodes[0], timeout=5 + 30 + 60)
    finally:
        for p in nodes:
            kill_tree(p.pid, signal.SIGKILL)
    assert code != 0
    assert waited < 5 + 30 + 10, f"survivor took {waited:.0f}s to give up"
    assert "FATAL" in out and "rank 1@" in out and "collective" in out, out[-2000:]


def environ_of(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            pairs = [item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item]
    except OSError:  # gone since it was listed
        return {}
    return {k.decode(): v.decode(errors="replace") for k, v in pairs}


def test_frozen_rank_of_the_host_is_given_up_on_in_shared_memory(tiny_data_dir, tiny_tokenizer_dir, tmp_path):
    """Two ranks of one host share memory. Rank 1 frozen (SIGSTOP) is alive, so the optimizer's
    pid check rightly keeps waiting for it, and no socket times out a wait on memory: the trainer's
    watchdog must stop rank 0 within --collective-timeout + its grace, naming the phase and step."""
    flags = tiny_flags(tiny_data_dir, tiny_tokenizer_dir, tmp_path, num_iterations=100000, checkpoint_every=0,
                       collective_timeout=5, local_comm="shm")
    node = spawn_node(1, 0, free_port(), train_target(*flags), nproc=2)
    try:
        seen = read_until(node, "step 00003", timeout=90)
        assert "local comm: shm: all 2 ranks on this host share" in seen
        rank1 = [pid for pid in descendants(node.pid) if environ_of(pid).get("RANK") == "1"]
        assert len(rank1) == 1, rank1
        os.kill(rank1[0], signal.SIGSTOP)
        t0 = time.monotonic()
        said = read_until(node, "FATAL", timeout=5 + 30 + 60)
        waited = time.monotonic() - t0
    finally:
        kill_tree(node.pid, signal.SIGKILL)
    # stuck polling (the watchdog), or in the step's closing barrier (Gloo's timeout): either way
    # the optimizer step's phase is named, with the step and the peer
    fatal = said.splitlines()[-1]
    assert re.search(r"rank 0/2\] FATAL: (stuck \d+s \(bound 35s, --collective-timeout\) in )?collective "
                     r"'optimizer step \(shared-memory work queue\)' at step \d+", fatal), fatal
    assert "rank 1@" in fatal, fatal
    assert waited < 5 + 30 + 10, f"rank 0 took {waited:.0f}s to give up"


# ---- bad flags -----------------------------------------------------------------------------------

BAD_FLAGS = [
    # (flags over tiny_flags, what the message must say)
    ({"depth": "two"}, "argument --depth: invalid int value: 'two'"),
    ({"matrix-lr": "fast"}, "argument --matrix-lr: invalid float value: 'fast'"),
    ({"device": "gpu"}, "argument --device: invalid choice: 'gpu'"),
    ({"depth": 0}, "--depth=0: must be a positive integer"),
    ({"num-iterations": -5}, "--num-iterations=-5: must be a positive integer"),
    ({"checkpoint-every": -1}, "--checkpoint-every=-1: must be >= 0"),
    ({"keep-checkpoints": 1}, "--keep-checkpoints=1: must be at least 2"),
    ({"collective-timeout": 0}, "--collective-timeout=0.0: must be > 0 seconds"),
    ({"collective-timeout": "nan"}, "--collective-timeout=nan: must be a finite number"),
    ({"matrix-lr": "inf"}, "--matrix-lr=inf: must be a finite number"),
    ({"embedding-lr": -0.1}, "--embedding-lr=-0.1: must be >= 0"),
    ({"warmdown-ratio": 1.5}, "--warmdown-ratio=1.5: must be in [0, 1]"),
    ({"window-pattern": "SXL"}, "--window-pattern='SXL': use only the letters S and L"),
    ({"rank-batch-sizes": "6,x"}, "--rank-batch-sizes='6,x': expected integers like '6,2'"),
    ({"rank-batch-sizes": "2,2,2"}, "--rank-batch-sizes='2,2,2': need 2 positive integers, one per rank"),
    ({"total-batch-size": 300}, "Nearest valid --total-batch-size: 256 or 512"),
    ({"seed": -1}, "--seed=-1: must be >= 0"),
]


@pytest.mark.parametrize(("over", "message"), BAD_FLAGS, ids=[m.split(":")[0] for _, m in BAD_FLAGS])
def test_bad_flag_is_named_with_its_value(over, message, tiny_data_dir, tiny_tokenizer_dir, tmp_path, capsys):
    """In-process: the parser and validate() every rank runs before rendezvous."""
    argv = tiny_flags(tiny_data_dir, tiny_tokenizer_dir, tmp_path / "run", **over)
    try:
        cfg = config.parse_config(argv)
        config.validate(cfg, world_size=2)
    except SystemExit as exc:  # argparse: type and choice errors, exit status 2
        assert exc.code == 2
        text = capsys.readouterr().err
    except config.ConfigError as exc:
        text = str(exc)
    else:
        pytest.fail(f"{over} was accepted")
    assert message in text, text


def test_missing_paths_and_unwritable_out_dir_are_named(tiny_data_dir, tiny_tokenizer_dir, tmp_path):
    """Per-host paths: collected by every rank and exchanged right after rendezvous."""
    for over, message in [
        ({"data_dir": tmp_path / "nope"}, f"--data-dir={tmp_path / 'nope'}: no such directory (run site.yml"),
        ({"tokenizer_dir": tmp_path / "nope"}, f"--tokenizer-dir={tmp_path / 'nope'}: no such directory"),
        ({"out_dir": tiny_data_dir / "manifest.json" / "run"},
         "/manifest.json/run: cannot create it (Not a directory)"),
    ]:
        paths = {"data_dir": tiny_data_dir, "tokenizer_dir": tiny_tokenizer_dir, "out_dir": tmp_path / "run", **over}
        cfg = config.parse_config(tiny_flags(paths["data_dir"], paths["tokenizer_dir"], paths["out_dir"]))
        config.validate(cfg, world_size=2)  # the flags themselves are fine
        [problem] = config.host_problems(cfg)
        assert message in problem, problem


def test_compile_on_without_a_cxx_compiler_is_named_and_auto_stays_eager(tiny_data_dir, tiny_tokenizer_dir,
                                                                         tmp_path, monkeypatch):
    """torch.compile on a CPU compiles C++: a host without a compiler is found before step 0."""
    monkeypatch.setenv("CXX", "no-such-compiler")
    cfg = config.parse_config(tiny_flags(tiny_data_dir, tiny_tokenizer_dir, tmp_path / "run", compile="on"))
    [problem] = config.host_problems(cfg)
    assert "--compile on: no C++ compiler (no-such-compiler) on this host" in problem and "install g++" in problem
    auto = config.parse_config(tiny_flags(tiny_data_dir, tiny_tokenizer_dir, tmp_path / "run", compile="auto"))
    assert config.host_problems(auto) == []
    assert resolve_compile(auto.compile, auto.device) == (
        "off", "auto: no C++ compiler (no-such-compiler) on this host for torch.compile's CPU code; install g++ to "
               "let auto measure it")
    monkeypatch.delenv("CXX")
    assert resolve_compile(auto.compile, auto.device)[0] == ("auto" if shutil.which("g++") else "off")


def test_bad_flag_stops_every_rank_before_rendezvous_and_touches_no_checkpoint(trained_run, tiny_data_dir,
                                                                              tiny_tokenizer_dir, tmp_path):
    runs = [copy_run(trained_run, tmp_path / f"node{r}") for r in range(2)]
    outs = two_nodes_fail([tiny_flags(tiny_data_dir, tiny_tokenizer_dir, run, collective_timeout="nan")
                           for run, _ in runs], code=config_exit())
    for out in outs:  # each node's own rank says it, before any rendezvous
        assert "FATAL: --collective-timeout=nan: must be a finite number" in out, out
        assert "fingerprint" not in out and "backend=" not in out
    for run, digest in runs:
        assert tree_digest(run / "checkpoints") == digest


# ---- bad data -------------------------------------------------------------------------------

def test_check_dataset_names_each_bad_file(tiny_data_dir, tmp_path):
    ok = tmp_path / "ok"
    shutil.copytree(tiny_data_dir, ok)
    assert data.check_dataset(ok, world_size=2) == []

    empty = tmp_path / "empty"
    shutil.copytree(tiny_data_dir, empty)
    write_empty_shard(empty / "shard_00003.parquet")
    rewrite_manifest_entry(empty, "shard_00003.parquet")
    [problem] = data.check_dataset(empty, world_size=2)
    assert "shard_00003.parquet: empty shard (0 rows)" in problem and "re-run site.yml" in problem

    garbage = tmp_path / "garbage"
    shutil.copytree(tiny_data_dir, garbage)
    (garbage / "shard_00002.parquet").write_bytes(os.urandom(4096))
    rewrite_manifest_entry(garbage, "shard_00002.parquet")
    [problem] = data.check_dataset(garbage, world_size=2)
    assert "shard_00002.parquet: not a readable parquet file" in problem

    drift = tmp_path / "drift"
    shutil.copytree(tiny_data_dir, drift)
    with open(drift / "shard_00001.parquet", "ab") as f:
        f.write(b"drift")
    digests = {n: data.sha256_file(drift / n) for n in ("shard_00001.parquet",)}
    [problem] = data.check_dataset(drift, world_size=2, digests=digests)
    assert "shard_00001.parquet: sha256" in problem and "does not match manifest.json" in problem

    # the val split is one shard of 4 row groups: 5 ranks cannot each get one
    [problem] = data.check_dataset(ok, world_size=5)
    assert "the val split (shard_00007.parquet) has 4 row group(s), fewer than the 5 ranks" in problem


def test_empty_and_corrupt_shards_stop_every_rank_with_the_file_names(trained_run, tiny_data_dir, tiny_tokenizer_dir,
                                                                      tmp_path):
    bad = bad_shards_copy(tiny_data_dir, tmp_path / "bad")
    runs = [copy_run(trained_run, tmp_path / f"node{r}") for r in range(2)]
    outs = two_nodes_fail([tiny_flags(bad, tiny_tokenizer_dir, run) for run, _ in runs], code=config_exit())
    for out in outs:
        assert "fingerprint agreed" in out  # identical on both nodes: caught by the content check
        assert "shard_00001.parquet: empty shard (0 rows)" in out
        assert "shard_00002.parquet: not a readable parquet file" in out
        assert "re-run site.yml" in out and "step 00013" not in out
    for run, digest in runs:
        assert tree_digest(run / "checkpoints") == digest


def test_missing_data_dir_on_one_node_stops_both_naming_that_node(trained_run, tiny_data_dir, tiny_tokenizer_dir,
                                                                   tmp_path):
    """Node 1 has no data dir: it must not leave before rendezvous (node 0 would wait for it in
    the rendezvous for the whole --collective-timeout); both stop together, naming node 1."""
    runs = [copy_run(trained_run, tmp_path / f"node{r}") for r in range(2)]
    outs = two_nodes_fail([tiny_flags(data, tiny_tokenizer_dir, run) for (run, _), data in
                           zip(runs, [tiny_data_dir, tmp_path / "nope"], strict=True)], code=config_exit())
    for out in outs:
        assert f"bad inputs, no rank starts: rank 1@{socket.gethostname()}: --data-dir={tmp_path / 'nope'}: " \
               "no such directory (run site.yml to push it)" in out, out
    for run, digest in runs:
        assert tree_digest(run / "checkpoints") == digest


# ---- tokenizers -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def other_tokenizer_dir(tmp_path_factory) -> Path:
    """A tokenizer trained on another corpus (made-up English sentences), vocab 300."""
    from tests.conftest import english_like_docs
    corpus = tmp_path_factory.mktemp("other_corpus")
    dataset_build.write_shards(english_like_docs(400, seed=7), corpus, rows_per_group=50, groups_per_shard=2,
                               val_docs=50, seed=1)
    out = tmp_path_factory.mktemp("other_tokenizer")
    tokenizer.train(corpus, 300, out)
    return out


def test_tokenizer_on_one_node_only_stops_both_with_the_fingerprint(trained_run, tiny_data_dir, tiny_tokenizer_dir,
                                                                    other_tokenizer_dir, tmp_path):
    runs = [copy_run(trained_run, tmp_path / f"node{r}") for r in range(2)]
    outs = two_nodes_fail([tiny_flags(tiny_data_dir, tok, run) for (run, _), tok in
                           zip(runs, [tiny_tokenizer_dir, other_tokenizer_dir], strict=True)], code=mismatch_exit())
    for out in outs:
        assert "run fingerprint mismatch" in out and "file tokenizer/tokenizer.json" in out
        assert "re-run site.yml" in out
    for run, digest in runs:
        assert tree_digest(run / "checkpoints") == digest


def test_resuming_with_another_tokenizer_is_refused_by_name(trained_run, tiny_data_dir, other_tokenizer_dir,
                                                            tmp_path):
    runs = [copy_run(trained_run, tmp_path / f"node{r}") for r in range(2)]
    outs = two_nodes_fail([tiny_flags(tiny_data_dir, other_tokenizer_dir, run, num_iterations=16)
                           for run, _ in runs], code=config_exit())
    for out in outs:
        assert "checkpoint" in out and "step_000012 was trained with another tokenizer" in out, out
        assert "vocab 512" in out and "vocab 300" in out and "another --run-name or --out-dir" in out
    for run, digest in runs:
        assert tree_digest(run / "checkpoints") == digest


def test_unusable_tokenizer_is_a_clear_error(tiny_data_dir, tiny_tokenizer_dir, tmp_path):
    raw = json.loads((tiny_tokenizer_dir / "tokenizer.json").read_text())
    raw["added_tokens"] = []
    del raw["model"]["vocab"]["<|bos|>"]
    no_bos, garbage = tmp_path / "no_bos", tmp_path / "garbage"
    for d in (no_bos, garbage):
        d.mkdir()
    (no_bos / "tokenizer.json").write_text(json.dumps(raw))
    (garbage / "tokenizer.json").write_text(json.dumps(raw)[:5000])
    for tok, message in [(no_bos, "no <|bos|> token; train it with"), (garbage, "cannot load tokenizer.json")]:
        proc = subprocess.run([sys.executable, "-m", "nanochat_cpu.train",
                               *tiny_flags(tiny_data_dir, tok, tmp_path / "run")],
                              env=node_env(), capture_output=True, text=True, timeout=60, cwd=REPO)
        assert proc.returncode == config_exit(), proc.stdout + proc.stderr
        assert f"FATAL: --tokenizer-dir={tok}: cannot load tokenizer.json" in proc.stdout, proc.stdout
        assert message in proc.stdout


# ---- the master port ------------------------------------------------------------------------

def test_foreign_process_on_master_port_fails_torchrun_at_once_naming_the_port(tiny_data_dir, tiny_tokenizer_dir,
                                                                               tmp_path):
    """`doctor`/the preflight name the holder (tests/test_doctor_netcheck.py); here: torchrun itself."""
    port = free_port()
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("127.0.0.1", port))
        holder.listen()
        t0 = time.monotonic()
        proc = subprocess.run(torchrun_cmd(1, port, train_target(*tiny_flags(tiny_data_dir, tiny_tokenizer_dir,
                                                                              tmp_path / "run"))),
                              env=node_env(), capture_output=True, text=True, timeout=120, cwd=REPO)
        took = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert took < FAIL_FAST_S, f"torchrun took {took:.0f}s"
    assert "EADDRINUSE" in out and f"port: {port}" in out, out[-3000:]
    assert not (tmp_path / "run" / "checkpoints").exists()



# ---- the preflight's run check: the trainer's own checks, on one node, before any unit starts ----

def run_check(flags: list[str], world_size: int = 2, first_rank: int = 0) -> list[str]:
    from nanochat_cpu.doctor import check_run
    return check_run(" ".join(flags), world_size, first_rank)


def test_run_check_passes_good_inputs_and_writes_nothing(tiny_data_dir, tiny_tokenizer_dir, tmp_path):
    out = tmp_path / "runs" / "new"
    assert run_check(tiny_flags(tiny_data_dir, tiny_tokenizer_dir, out)) == []
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(("over", "message"), [
    ({"matrix-lr": "fast"}, "argument --matrix-lr: invalid float value: 'fast'"),
    ({"dtype": "fp16"}, "argument --dtype: invalid choice: 'fp16'"),
    ({"total-batch-size": 300}, "--total-batch-size=300 is not divisible by"),
    ({"depth": 0}, "--depth=0"),
])
def test_run_check_names_a_bad_flag(over, message, tiny_data_dir, tiny_tokenizer_dir, tmp_path):
    [problem] = run_check(tiny_flags(tiny_data_dir, tiny_tokenizer_dir, tmp_path / "run", **over))
    assert problem.startswith(f"{socket.gethostname()}: ") and message in problem, problem


def test_run_check_names_bad_shards_missing_dirs_and_an_unwritable_out_dir(tiny_data_dir, tiny_tokenizer_dir,
                                                                         tmp_path):
    bad = bad_shards_copy(tiny_data_dir, tmp_path / "bad")
    problems = run_check(tiny_flags(bad, tiny_tokenizer_dir, tmp_path / "run"))
    assert len(problems) == 2, problems
    assert "shard_00001.parquet: empty shard (0 rows)" in problems[0]
    assert "shard_00002.parquet: not a readable parquet file" in problems[1]

    [problem] = run_check(tiny_flags(tmp_path / "nowhere", tiny_tokenizer_dir, tmp_path / "run"))
    assert "--data-dir=" in problem and "no such directory" in problem
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    if os.getuid() != 0:  # root may write anywhere; the preflight runs the check as the unit's user
        [problem] = run_check(tiny_flags(tiny_data_dir, tiny_tokenizer_dir, locked / "run"))
        assert "is not writable by uid" in problem


@pytest.mark.skipif(os.getuid() != 0, reason="mounts a 2 MiB tmpfs")
def test_run_check_names_a_disk_too_small_for_the_runs_checkpoints(trained_run, tiny_data_dir, tiny_tokenizer_dir,
                                                                   tmp_path):
    """The preflight's check: --keep-checkpoints of them and the one being written must fit, each
    as big as the node's newest (or, before the first, estimated from the model)."""
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "faults-test", str(small)], check=True)
    try:
        [problem] = run_check(tiny_flags(tiny_data_dir, tiny_tokenizer_dir, small / "run"))
        assert re.search(r"--out-dir=\S+/small/run: 2 MiB free on its disk, but the run's checkpoints need \d+ MiB "
                         r"more \(3 kept \+ 1 being written, 1\.\d MiB each: estimated from the model's weights\)\. "
                         r"Fix: free space", problem), problem
        # compressed outer syncs: each node's first rank keeps an fp32 residual of the whole model
        [compressed] = run_check(tiny_flags(tiny_data_dir, tiny_tokenizer_dir, small / "run", sync_every=4,
                                            outer_compress="int4"))
        each = [float(re.search(r"([\d.]+) MiB each", said).group(1)) for said in (problem, compressed)]
        assert each[1] == pytest.approx(2 * each[0], rel=0.1), each  # two nodes at least: 2 + 2 bytes a weight byte
    finally:
        subprocess.run(["umount", str(small)], check=True)
    run, _ = copy_run(trained_run, tmp_path / "node0")  # 3 of its checkpoints held: room for one more needed
    assert run_check(tiny_flags(tiny_data_dir, tiny_tokenizer_dir, run, num_iterations=16)) == []


def test_run_check_refuses_to_resume_with_another_tokenizer_or_depth(trained_run, tiny_data_dir, tiny_tokenizer_dir,
                                                                     other_tokenizer_dir, tmp_path):
    run, digest = copy_run(trained_run, tmp_path / "node0")
    [problem] = run_check(tiny_flags(tiny_data_dir, other_tokenizer_dir, run))
    assert "step_000012 was trained with another tokenizer" in problem and "vocab 300" in problem, problem
    [problem] = run_check(tiny_flags(tiny_data_dir, tiny_tokenizer_dir, run, depth=3))
    assert "step_000012 does not fit this model (--depth 3" in problem and "new run_name" in problem, problem
    # the same run resumes; --resume never over its checkpoints is refused; nothing was written
    assert run_check(tiny_flags(tiny_data_dir, tiny_tokenizer_dir, run, num_iterations=16)) == []
    [problem] = run_check(tiny_flags(tiny_data_dir, other_tokenizer_dir, run, resume="never"))
    assert "--resume never, but" in problem and "steps [4, 8, 12]" in problem and "new run_name" in problem, problem
    assert tree_digest(run / "checkpoints") == digest


def test_a_checkpoint_that_lost_a_rank_file_on_every_disk_is_named_never_trained_over(tiny_data_dir,
                                                                                      tiny_tokenizer_dir, tmp_path):
    """Two ranks on one disk; each sealed checkpoint's rank1.pt deleted afterwards. With none whole
    the run stops naming the steps, the host and the file, and leaves every file as it was (it used
    to start at step 1 silently and write its steps over them). With an older one whole it resumes
    from that one, naming the newer one it passes over."""
    out = tmp_path / "run"
    flags = tiny_flags(tiny_data_dir, tiny_tokenizer_dir, out, checkpoint_every=10, num_iterations=12)
    first = run_torchrun(2, train_target(*flags))
    assert first.returncode == 0, first.stdout + first.stderr
    ck = out / "checkpoints"
    assert checkpoint_files.complete_steps(str(out)) == [10, 12]
    kept = (ck / "step_000010" / "rank1.pt").read_bytes()
    for step in (10, 12):
        (ck / f"step_{step:06d}" / "rank1.pt").unlink()
    before = tree_digest(out / "checkpoints")
    longer = tiny_flags(tiny_data_dir, tiny_tokenizer_dir, out, checkpoint_every=10, num_iterations=20)

    t0 = time.monotonic()
    stopped = run_torchrun(2, train_target(*longer))
    said = stopped.stdout + stopped.stderr
    assert stopped.returncode == 2, said
    host = socket.gethostname()
    assert re.search(rf"lost files on every disk \(step 10: {re.escape(host)} lacks rank1\.pt; "
                     rf"step 12: {re.escape(host)} lacks rank1\.pt\)", said), said
    assert not losses(stopped.stdout), "a step was trained over the checkpoints"
    assert time.monotonic() - t0 < FAIL_FAST_S * 4
    assert tree_digest(out / "checkpoints") == before, "the stopped run changed the checkpoints"

    (ck / "step_000010" / "rank1.pt").write_bytes(kept)  # step 10 whole again, step 12 still not
    resumed = run_torchrun(2, train_target(*longer))
    said = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, said
    assert f"newer than step 10 were sealed and have since lost files on every disk (step 12: {host} lacks " \
           "rank1.pt): resuming from step 10" in said, said
    assert "resumed from checkpoint step 10" in said and sorted(losses(resumed.stdout)) == list(range(11, 21))
