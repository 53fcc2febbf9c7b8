"""A run survives its cluster changing: real torchrun + Gloo 'nodes' (one launcher each) on loopback,
each with its own --out-dir as real nodes have their own disks.

A node added (2 -> 3 ranks), one removed (3 -> 2), a node's run directory wiped, a stop by
SIGTERM, and `--resume never` over an existing run: each time the run goes on from its newest
checkpoint, or every rank refuses with the fix, and never starts again from step 1.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import shutil
import signal
import time
from pathlib import Path

import pytest

from nanochat_cpu import checkpoint_files
from nanochat_cpu.dist import EXIT_CONFIG, EXIT_STOPPED
from nanochat_cpu.stop import StopBudget, shutdown_budget_s
from tests.conftest import TINY_VOCAB
from tests.test_faults_trainer import tree_digest
from tests.trainer_runs import (
    SLOW_CHECKPOINT_TRAIN,
    SMALL_ROUNDS,
    finish,
    free_port,
    kill_tree,
    losses,
    node_env,
    read_until,
    spawn_node,
    tiny_flags,
    train_target,
)

UNIFORM = math.log(TINY_VOCAB)  # the loss of a model that has learnt nothing


def run_nodes(flags_of_node: list[list[str]], timeout: float = 180, small_rounds: bool = False,
              ) -> list[tuple[int, str]]:
    """One launcher per node, all of them to the end: (exit code, output) of each; small_rounds:
    checkpoint files and states cross in rounds of a few KiB, many rounds each."""
    port, env = free_port(), {**node_env(), **SMALL_ROUNDS} if small_rounds else None
    procs = [spawn_node(len(flags_of_node), r, port, [SLOW_CHECKPOINT_TRAIN, *flags] if small_rounds
                        else train_target(*flags), env=env) for r, flags in enumerate(flags_of_node)]
    try:
        return [finish(p, timeout=timeout)[:2] for p in procs]
    finally:
        for p in procs:
            kill_tree(p.pid, signal.SIGKILL)


def node_flags(data: Path, tok: Path, run: Path, nodes: int, **over) -> list[list[str]]:
    """Each node's flags; 768 tokens a step divide over 2 and over 3 ranks alike."""
    return [tiny_flags(data, tok, run / f"node{r}", **{"total_batch_size": 768, **over}) for r in range(nodes)]


def ok(results: list[tuple[int, str]]) -> str:
    for code, out in results:
        assert code == 0, out
    return results[0][1]


def trained_to_step_8(data: Path, tok: Path, run: Path) -> dict[int, float]:
    """Two nodes train 12 steps (checkpoints at 4, 8, 12); step 12's is then dropped on both, as if
    the run had stopped after step 8 (the same LR schedule as the 12-step run). Its losses."""
    whole = losses(ok(run_nodes(node_flags(data, tok, run, 2))))
    for r in range(2):
        for path in sorted(Path(checkpoint_files.step_dir(str(run / f"node{r}"), 12)).rglob("*"), reverse=True):
            path.unlink()
        Path(checkpoint_files.step_dir(str(run / f"node{r}"), 12)).rmdir()
    return whole


def test_a_node_added_then_one_removed_goes_on_from_the_checkpoint(tiny_data_dir, tiny_tokenizer_dir, tmp_path):
    run = tmp_path / "run"
    whole = trained_to_step_8(tiny_data_dir, tiny_tokenizer_dir, run)
    # a third node joins with an empty disk: it gets the checkpoint, and the run goes on at step 9
    # (its files cross in rounds of 8 KiB, and land byte for byte)
    results = run_nodes(node_flags(tiny_data_dir, tiny_tokenizer_dir, run, 3), small_rounds=True)
    out = ok(results)
    assert "resumed step 8, written by 2 ranks on hosts" in out and "re-sharded to 3 ranks" in out, out
    assert "checkpoint step 8 was missing on this disk: restored from rank 0@" in results[2][1], results[2][1]
    node0, node2 = (run / f"node{r}" / "checkpoints" / "step_000008" for r in (0, 2))
    for name in ("model.pt", "rank0.pt", "rank1.pt", "COMPLETE"):
        assert (node2 / name).read_bytes() == (node0 / name).read_bytes(), name
    assert (node0 / "model.pt").stat().st_size > 10 * int(SMALL_ROUNDS["CHUNK_BYTES"])  # many rounds, not one
    grown = losses(out)
    assert sorted(grown) == list(range(9, 13))  # no step redone, none skipped, no restart at step 1
    # the curve goes on: close to the uninterrupted run's, far from untrained. Other rows per rank,
    # and the old ranks' best-fit buffers dealt out anew: the first rows hold other documents (steps
    # 9 and 10 read 11-13% lower here, 11 and 12 within 2%)
    for step in range(9, 13):
        assert abs(grown[step] - whole[step]) < 0.2 * whole[step], (step, grown[step], whole[step])
        assert grown[step] < UNIFORM - 1, (step, grown[step])
    marker = json.loads((run / "node2" / "checkpoints" / "step_000012" / "COMPLETE").read_text())
    assert marker["world_size"] == 3 and marker["files"] == ["model.pt", "rank0.pt", "rank1.pt", "rank2.pt"]
    # node2 leaves again: two nodes go on from the three-rank checkpoint at step 12
    out = ok(run_nodes(node_flags(tiny_data_dir, tiny_tokenizer_dir, run, 2, num_iterations=16)))
    assert "resumed step 12, written by 3 ranks" in out and "re-sharded to 2 ranks" in out, out
    shrunk = losses(out)
    assert sorted(shrunk) == list(range(13, 17)) and all(loss < UNIFORM - 1 for loss in shrunk.values()), shrunk


def test_a_wiped_node_gets_the_checkpoint_back_and_the_run_repeats_exactly(tiny_data_dir, tiny_tokenizer_dir,
                                                                             tmp_path):
    run = tmp_path / "run"
    whole = trained_to_step_8(tiny_data_dir, tiny_tokenizer_dir, run)
    for path in sorted((run / "node1").rglob("*"), reverse=True):  # a new disk: nothing of the run is left
        path.rmdir() if path.is_dir() else path.unlink()
    results = run_nodes(node_flags(tiny_data_dir, tiny_tokenizer_dir, run, 2))
    out = ok(results)
    assert "restored from rank 0@" in results[1][1], results[1][1]
    assert "resumed from checkpoint step 8" in out, out
    # the same layout: the resumed run computes exactly what the uninterrupted one did
    assert losses(out) == pytest.approx({s: whole[s] for s in range(9, 13)}, abs=1e-4)
    # the other node's checkpoints survived; the wiped one holds the restored one and the new one
    assert checkpoint_files.complete_steps(str(run / "node0")) == [4, 8, 12]
    assert checkpoint_files.complete_steps(str(run / "node1")) == [8, 12]


def test_resume_never_over_a_run_is_refused_by_every_rank(tiny_data_dir, tiny_tokenizer_dir, tmp_path):
    run = tmp_path / "run"
    ok(run_nodes(node_flags(tiny_data_dir, tiny_tokenizer_dir, run, 2, num_iterations=4)))
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    for code, out in run_nodes(node_flags(tiny_data_dir, tiny_tokenizer_dir, run, 2, resume="never")):
        assert code == EXIT_CONFIG, out
        assert "--resume never, but" in out and "rank 1@" in out and "steps [4]" in out, out
        assert "another --run-name or --out-dir" in out, out
        assert "step 00001" not in out
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_sigterm_on_one_node_stops_both_with_a_checkpoint_and_loses_no_step(tiny_data_dir, tiny_tokenizer_dir,
                                                                              tmp_path):
    """systemctl stop on one node: its launcher forwards SIGTERM to its rank, the ranks agree on the
    step, save it and exit; the next start resumes at exactly that step."""
    run = tmp_path / "run"
    flags = node_flags(tiny_data_dir, tiny_tokenizer_dir, run, 2, num_iterations=400, checkpoint_every=100)
    port = free_port()
    procs = [spawn_node(2, r, port, train_target(*f)) for r, f in enumerate(flags)]
    try:
        seen = read_until(procs[1], "step 00003", timeout=120)
        procs[1].send_signal(signal.SIGTERM)  # the launcher, as KillMode=mixed does
        t0 = time.monotonic()
        results = [finish(p, timeout=120) for p in procs]
    finally:
        for p in procs:
            kill_tree(p.pid, signal.SIGKILL)
    stopped_in = time.monotonic() - t0
    assert results[1][0] == 128 + signal.SIGTERM, results[1][1]  # the launcher says it was stopped
    # the other node's ranks stopped with it: 5, a clean stop to the unit, which neither restarts
    # it (it would wait for the stopped node) nor disables it (it rejoins at boot)
    assert results[0][0] == EXIT_STOPPED, results[0][1]
    assert "launcher: the ranks stopped at a checkpoint" in results[0][1]
    stops = [int(s) for s in re.findall(r"stopped by SIGTERM after step (\d+) of 400", results[0][1])]
    assert len(stops) == 1, results[0][1]
    stop = stops[0]
    assert f"stopped by SIGTERM after step {stop} of 400" in seen + results[1][1]
    assert 3 <= stop < 400 and stopped_in < 60
    for node in ("node0", "node1"):
        assert checkpoint_files.complete_steps(str(run / node)) == [stop], node
    out = ok(run_nodes(node_flags(tiny_data_dir, tiny_tokenizer_dir, run, 2, num_iterations=stop + 2)))
    assert f"resumed from checkpoint step {stop}" in out
    assert sorted(losses(out)) == [stop + 1, stop + 2]  # zero steps lost


def test_a_stop_that_would_outlast_torchruns_wait_is_said_once_with_the_setting_that_holds_it(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert shutdown_budget_s() is None  # not under torchrun: nothing kills a stop
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    assert shutdown_budget_s() == 30.0  # torchrun's default
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "270")
    assert shutdown_budget_s() == 270.0
    assert StopBudget(None).check(50, 30.0, [(50, 900.0)], crossing=True) is None
    budget = StopBudget(270.0)
    assert budget.check(50, 30.0, [None, None], crossing=True) is None  # nothing timed yet
    assert budget.check(50, 30.0, [(50, 230.0)], crossing=False) is None  # 260 s: one checkpoint fits
    # with local steps a stop may meet one crossing: 30 + 2 x 230 s; the slower of those known counts
    line = budget.check(100, 30.0, [(50, 100.0), (100, 230.0)], crossing=True)
    assert line is not None and "would take ~490 s" in line and "as checkpoint step 100 took" in line
    assert "trainer_graceful_stop_sec=780 -e trainer_stop_timeout_sec=810" in line  # 1.5 x 490 s, whole minutes
    assert budget.check(150, 30.0, [(150, 500.0)], crossing=True) is None  # said once


def test_prune_keeps_what_it_sealed_and_never_touches_newer_checkpoints(tmp_path):
    """An old run's high-numbered checkpoints must not make the new checkpoints be pruned, and a
    run with fewer checkpoints than it keeps keeps them all."""
    out = str(tmp_path)
    layout = {"world_size": 1, "hosts": ["h"], "node_of_rank": [0]}

    def seal(step: int, keep: int = 2, where: str = out) -> None:
        digests = checkpoint_files.write_step_files(where, step, {"w": step}, [b"rank 0's state"])
        checkpoint_files.mark_complete(where, step, layout, digests, keep=keep)

    seal(40)
    (Path(checkpoint_files.step_dir(out, 50))).mkdir()  # an unsealed one, maybe being written
    for step in (4, 8, 12):
        seal(step)
    assert checkpoint_files.complete_steps(out) == [8, 12, 40]
    assert checkpoint_files.list_steps(out) == [8, 12, 40, 50]
    # fewer checkpoints than --keep-checkpoints so far: every one of them stays
    fresh = str(tmp_path / "fresh")
    for step in (4, 8, 12, 16):
        seal(step, keep=5, where=fresh)
    assert checkpoint_files.complete_steps(fresh) == [4, 8, 12, 16]


def test_local_steps_stop_mid_phase_then_go_on_with_a_node_more(tiny_data_dir, tiny_tokenizer_dir, tmp_path):
    """With local steps a stop mid-phase is made an outer boundary (the checkpoint holds theta_global);
    a third node then continues node 0's inner optimizer, the outer state re-sharded over three
    (with --outer-compress, the two nodes' residuals summed and shared out)."""
    run = tmp_path / "run"
    flags = node_flags(tiny_data_dir, tiny_tokenizer_dir, run, 2, num_iterations=400, checkpoint_every=100,
                       sync_every=50, sync_warmup_ratio=0, outer_compress="int4")
    port = free_port()
    procs = [spawn_node(2, r, port, train_target(*f)) for r, f in enumerate(flags)]
    try:
        seen = read_until(procs[0], "step 00012", timeout=180)
        procs[0].send_signal(signal.SIGTERM)
        results = [finish(p, timeout=120) for p in procs]
    finally:
        for p in procs:
            kill_tree(p.pid, signal.SIGKILL)
    assert [code for code, _, _ in results] == [128 + signal.SIGTERM, EXIT_STOPPED], results
    stop = int(re.search(r"stopped by SIGTERM after step (\d+) of 400", results[1][1]).group(1))
    assert f"outer step 1 at step {stop:05d}:" in results[1][1]  # the nodes met at the stop, not at step 50
    out = ok(run_nodes(node_flags(tiny_data_dir, tiny_tokenizer_dir, run, 3, num_iterations=stop + 4,
                                  sync_every=50, sync_warmup_ratio=0, outer_compress="int4")))
    assert f"resumed step {stop}, written by 2 ranks" in out and "re-sharded to 3 ranks" in out, out
    resumed, before = losses(out), losses(seen + results[0][1])
    assert sorted(resumed) == list(range(stop + 1, stop + 5))
    # the curve goes on from where it stopped, nowhere near an untrained model's
    assert abs(resumed[stop + 1] - before[stop]) < 0.15 * before[stop] and resumed[stop + 1] < UNIFORM - 1, (
        before, resumed)
    assert f"outer step 2 at step {stop + 4:05d}:" in out  # the outer step count went on from the checkpoint


def flip_a_byte(path: Path) -> None:
    """One bit of a tensor's bytes in the middle of the file flipped: torch's zip reader checks no
    CRC, so this loads silently as another number."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def test_bad_bytes_on_one_disk_are_restored_from_a_good_copy_and_the_run_repeats_exactly(tiny_data_dir,
                                                                                       tiny_tokenizer_dir, tmp_path):
    """A flipped bit in node 1's model.pt of step 8: its copy no longer counts, node 0's good one is
    restored onto it, and the run computes exactly what the uninterrupted one did."""
    run = tmp_path / "run"
    whole = trained_to_step_8(tiny_data_dir, tiny_tokenizer_dir, run)
    flip_a_byte(run / "node1" / "checkpoints" / "step_000008" / "model.pt")
    results = run_nodes(node_flags(tiny_data_dir, tiny_tokenizer_dir, run, 2))
    out = ok(results)
    assert re.search(r"WARNING: checkpoint step 8: \S+'s copy of model\.pt differ from the sha256 sealed with them "
                     r".*: those disks get a good copy", out), out
    assert "checkpoint step 8 was missing on this disk: restored from rank 0@" in results[1][1], results[1][1]
    assert "resumed from checkpoint step 8" in out, out
    assert losses(out) == pytest.approx({s: whole[s] for s in range(9, 13)}, abs=1e-4)


def test_bad_bytes_on_every_copy_go_back_to_the_step_before(tiny_data_dir, tiny_tokenizer_dir, tmp_path):
    run = tmp_path / "run"
    whole = trained_to_step_8(tiny_data_dir, tiny_tokenizer_dir, run)
    for r in range(2):
        flip_a_byte(run / f"node{r}" / "checkpoints" / "step_000008" / "rank1.pt")
    out = ok(run_nodes(node_flags(tiny_data_dir, tiny_tokenizer_dir, run, 2)))
    assert "no disk holds a good copy" in out, out
    assert re.search(r"checkpoints newer than step 4 were sealed and have since lost files on every disk \(step 8: "
                     r"\S+ lacks rank1\.pt \(bytes other than its sha256\)\): resuming from step 4", out), out
    assert losses(out) == pytest.approx({s: whole[s] for s in range(5, 13)}, abs=1e-4)


def test_a_checkpoint_one_disk_cannot_read_stops_every_rank_naming_it(tiny_data_dir, tiny_tokenizer_dir, tmp_path):
    """Node 1's copy of step 4, sealed by a version that kept no sha256, is cut short after it was
    sealed (a failing disk): every rank exits 2 naming rank 1, instead of rank 0 timing out in the
    next collective and restarting in a loop."""
    run = tmp_path / "run"
    ok(run_nodes(node_flags(tiny_data_dir, tiny_tokenizer_dir, run, 2, num_iterations=4)))
    for r in range(2):
        complete = run / f"node{r}" / "checkpoints" / "step_000004" / "COMPLETE"
        complete.write_text(json.dumps({k: v for k, v in json.loads(complete.read_text()).items() if k != "sha256"}))
    bad = run / "node1" / "checkpoints" / "step_000004" / "rank1.pt"
    bad.write_bytes(bad.read_bytes()[:100])
    for code, out in run_nodes(node_flags(tiny_data_dir, tiny_tokenizer_dir, run, 2, num_iterations=8)):
        assert code == EXIT_CONFIG, out
        assert re.search(r"FATAL: rank 1@\S+: checkpoint \S+step_000004 cannot be resumed", out), out
        assert "step 00005" not in out


def test_an_older_versions_checkpoints_are_not_skipped_when_a_node_is_added(tiny_data_dir, tiny_tokenizer_dir,
                                                                             tmp_path):
    """Checkpoints sealed before every disk held every rank's state: with a third node, nobody holds
    one whole, and the run must not silently start again from step 1."""
    run = tmp_path / "run"
    ok(run_nodes(node_flags(tiny_data_dir, tiny_tokenizer_dir, run, 2, num_iterations=4)))
    for r in range(2):  # as the older version left them: each disk its own rank's file
        d = run / f"node{r}" / "checkpoints" / "step_000004"
        (d / f"rank{1 - r}.pt").unlink()
        (d / "COMPLETE").write_text(json.dumps({"step": 4, "files": ["model.pt", f"rank{r}.pt"]}))
    for code, out in run_nodes(node_flags(tiny_data_dir, tiny_tokenizer_dir, run, 3, num_iterations=8)):
        assert code == EXIT_CONFIG, out
        assert "written by an older version" in out and "rank 2@" in out and "steps [4]" in out, out
        assert "step 00001" not in out


# ---- whose checkpoints: the run's identity, and the data it trained on ---------------------------

def run_id_of(out: Path, step: int) -> str:
    return json.loads((Path(checkpoint_files.step_dir(str(out), step)) / "COMPLETE").read_text())["run_id"]


def test_another_runs_checkpoint_on_one_disk_is_never_taken_over(tiny_data_dir, tiny_tokenizer_dir, tmp_path):
    """Run B trains on two nodes to step 12; a checkpoint of an unrelated run A (another seed, the
    same shape) at step 16 lies on node 1's disk, as on a laptop that kept an earlier cluster's run
    of the same name. B started again without its id stops naming both runs and touches nothing;
    given its id it resumes from its own step 12, and A's checkpoint is set aside, byte for byte."""
    run_a, run = tmp_path / "a", tmp_path / "run"
    ok(run_nodes([tiny_flags(tiny_data_dir, tiny_tokenizer_dir, run_a, seed=7, num_iterations=16,
                             checkpoint_every=16, total_batch_size=768)]))
    whole = losses(ok(run_nodes(node_flags(tiny_data_dir, tiny_tokenizer_dir, run, 2))))
    stale = Path(checkpoint_files.step_dir(str(run / "node1"), 16))
    shutil.copytree(checkpoint_files.step_dir(str(run_a), 16), stale)
    a_id, b_id = run_id_of(run_a, 16), run_id_of(run / "node0", 12)
    assert a_id != b_id and run_id_of(run / "node1", 12) == b_id
    before = {r: tree_digest(run / f"node{r}") for r in range(2)}

    for code, out in run_nodes(node_flags(tiny_data_dir, tiny_tokenizer_dir, run, 2, num_iterations=20)):
        assert code == EXIT_CONFIG, out
        assert "holds checkpoints of 2 runs" in out and f"steps [16] of run {a_id}" in out, out
        assert f"steps [4, 8, 12] of run {b_id}" in out and "--run-id <one of them>" in out, out
        assert "step 00001" not in out and "step 00013" not in out
    assert {r: tree_digest(run / f"node{r}") for r in range(2)} == before, "the stopped run changed a disk"

    results = run_nodes(node_flags(tiny_data_dir, tiny_tokenizer_dir, run, 2, num_iterations=20, run_id=b_id))
    out = ok(results)
    assert "resumed from checkpoint step 12" in out and f"id {b_id} (resumed" in out, out
    assert sorted(losses(out)) == list(range(13, 21))
    assert losses(out)[13] == pytest.approx(whole[12], rel=0.2)  # B's curve goes on, not A's
    aside = run / "node1" / "checkpoints" / "other-runs" / a_id / "step_000016"
    assert f"set aside, nothing deleted: step 16 of run {a_id} to {aside}" in results[1][1], results[1][1]
    assert tree_digest(aside) == {k.removeprefix("checkpoints/step_000016/"): v for k, v in before[1].items()
                                  if k.startswith("checkpoints/step_000016/")}
    assert checkpoint_files.complete_steps(str(run / "node1")) == [12, 16, 20]  # all B's: A's is not pruned
    assert run_id_of(run / "node1", 16) == b_id


def test_a_run_whose_id_no_disk_holds_stops_beside_another_runs_checkpoints(tiny_data_dir, tiny_tokenizer_dir,
                                                                           tmp_path):
    """train.yml's case: the run has its id, node 0's disk is new, node 1 holds only an earlier
    run's checkpoints of the same name: every rank stops naming them and the fix, nothing is moved."""
    run = tmp_path / "run"
    ok(run_nodes(node_flags(tiny_data_dir, tiny_tokenizer_dir, run, 1, num_iterations=4)))
    old_id, before = run_id_of(run / "node0", 4), tree_digest(run / "node0")
    (run / "node0").rename(run / "node1")
    for code, out in run_nodes(node_flags(tiny_data_dir, tiny_tokenizer_dir, run, 2, run_id="fresh-run-1")):
        assert code == EXIT_CONFIG, out
        assert "this is run fresh-run-1, and no disk under" in out and f"steps [4] of run {old_id}" in out, out
        assert "-e run_id=<id>" in out and "step 00001" not in out, out
    assert tree_digest(run / "node1") == before


def test_resuming_onto_other_data_stops_naming_both_manifests_unless_said(tiny_data_dir, tiny_tokenizer_dir,
                                                                         tmp_path):
    run, other = tmp_path / "run", tmp_path / "other_data"
    ok(run_nodes([tiny_flags(tiny_data_dir, tiny_tokenizer_dir, run, num_iterations=4, total_batch_size=768)]))
    shutil.copytree(tiny_data_dir, other)  # the same corpus less its first train shard
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["files"] = [e for e in manifest["files"] if e["file"] != "shard_00000.parquet"]
    (other / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    (other / "shard_00000.parquet").unlink()
    old, new = (hashlib.sha256((d / "manifest.json").read_bytes()).hexdigest()[:16] for d in (tiny_data_dir, other))
    flags = tiny_flags(other, tiny_tokenizer_dir, run, num_iterations=8, total_batch_size=768)
    [(code, out)] = run_nodes([flags])
    assert code == EXIT_CONFIG, out
    assert f"trained on other data (manifest sha256 {old})" in out and f"(manifest sha256 {new})" in out, out
    assert "--data-changed" in out and "step 00005" not in out, out
    [(code, out)] = run_nodes([[*flags, "--data-changed"]])
    assert code == 0, out
    assert "resumed from checkpoint step 4" in out and "the loader starts the new data at its beginning" in out, out
    assert sorted(losses(out)) == [5, 6, 7, 8]


def test_which_checkpoints_are_this_runs(monkeypatch):
    """claim's rules on two disks' markers: a step sealed before runs had ids is this run's history
    only where it is older than the run's first step with its id; a newer one, another run's and a
    marker whose id is no id are set aside (never a path outside other-runs); with no step of its
    own id beside another run's, the run stops."""
    from nanochat_cpu import run_identity
    from nanochat_cpu.dist import DistEnv

    def stops(env, code, msg):
        raise SystemExit(f"{code}: {msg}")

    monkeypatch.setattr(run_identity, "fail", stops)
    env = DistEnv(rank=0, world_size=2, backend="gloo", host="ws", hosts=["ws", "laptop"])

    def marker(run_id=None):
        return {"world_size": 2} | ({"run_id": run_id} if run_id else {})

    ws = {4: marker(), 8: marker("B"), 12: marker("B")}  # B's history from before ids, then B's own
    laptop = {8: marker("B"), 16: marker(), 20: marker("../../etc"), 24: marker("A")}
    claimed = run_identity.claim("B", "new", env, "/r", [ws, laptop], [{}, {}])
    assert claimed.run_id == "B"
    assert claimed.everyone == [{4: ws[4], 8: ws[8], 12: ws[12]}, {8: laptop[8]}]
    assert claimed.others == [{}, {16: run_identity.NO_ID, 20: run_identity.BAD_ID, 24: "A"}]
    # without --run-id the disks' runs are a guess: B, A and the unreadable one
    with pytest.raises(SystemExit, match=r"2: /r holds checkpoints of 3 runs .*laptop: steps \[24\] of run A"):
        run_identity.claim("", "new", env, "/r", [ws, laptop], [{}, {}])
    # only steps from before ids: the run's own history, whichever id it is given or draws
    assert run_identity.claim("", "new", env, "/r", [{4: marker()}, {}], [{}, {}]).run_id == "new"
    assert run_identity.claim("C", "new", env, "/r", [{4: marker()}, {}], [{}, {}]).everyone == [{4: marker()}, {}]
    # another run's steps and none of this id: stopped, naming them, even beside steps from before ids
    with pytest.raises(SystemExit, match=r"this is run C, and no disk under /r holds .*laptop: steps \[24\] of run A"):
        run_identity.claim("C", "new", env, "/r", [{4: marker()}, {24: marker("A")}], [{}, {}])
