"""Local steps across nodes (sync_diloco.py) on real torchrun launchers and Gloo: each launcher is a node.
What auto chooses from given timings, with no process, is test_local_steps_policy.py."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from nanochat_cpu import checkpoint_files
from nanochat_cpu.outer_codec import codec_named, send_with_feedback
from nanochat_cpu.outer_policy import AUTO_FIRST_PHASE
from nanochat_cpu.run_state import RunState
from tests.entry_points.local_steps_worker import OUTER_LR, OUTER_MOMENTUM
from tests.trainer_runs import (
    ENTRY_POINTS,
    REPO,
    SLOW_CHECKPOINT_TRAIN,
    free_port,
    kill_tree,
    losses,
    node_env,
    read_until,
    spawn_node,
    tiny_flags,
    train_target,
)

WORKER = str(ENTRY_POINTS / "local_steps_worker.py")
LATE_TRAIN = str(ENTRY_POINTS / "late_node_train.py")
SLOW_TRAIN = str(ENTRY_POINTS / "slow_compute_train.py")


def run_nodes(nodes: int, target: list[str], nproc: int = 1, env_extra: dict[str, str] | None = None,
              timeout: float = 240) -> list[tuple[int, str]]:
    """Every node's (exit code, output): `nodes` launchers of `nproc` ranks each, on loopback."""
    port, env = free_port(), {**node_env(), **(env_extra or {})}
    procs = [spawn_node(nodes, n, port, target, nproc=nproc, env=env) for n in range(nodes)]
    return collect(procs, timeout)


def collect(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str]]:
    """Every node's (exit code, output). A node that fails stops the others: they would wait for
    it in the rendezvous or a collective for minutes, hiding its error behind a timeout."""
    outs: list[list[str]] = [[] for _ in procs]
    readers = [threading.Thread(target=lambda p=p, out=out: out.extend(p.stdout), daemon=True)
               for p, out in zip(procs, outs, strict=True)]  # a full pipe would block a node
    for r in readers:
        r.start()
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if any(p.returncode not in (None, 0) for p in procs):
            break
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            kill_tree(p.pid, signal.SIGKILL)
    for r in readers:
        r.join(timeout=30)
    return [(p.wait(), "".join(out)) for p, out in zip(procs, outs, strict=True)]


def assert_ok(results: list[tuple[int, str]]) -> str:
    for code, out in results:
        assert code == 0, out
    return "".join(out for _, out in results)


def two_nodes(flags) -> str:
    """Node 0's output of two nodes (one rank each), each with its own run directory as on real
    machines: `flags(node)` is node's trainer target."""
    port = free_port()
    results = collect([spawn_node(2, n, port, flags(n)) for n in range(2)], 240)
    assert_ok(results)
    return results[0][1]


@pytest.fixture(scope="module")
def one_node(tmp_path_factory) -> dict[str, torch.Tensor]:
    out = tmp_path_factory.mktemp("alone") / "params.pt"
    proc = subprocess.run([sys.executable, WORKER, "identical", str(out), "1"], env=node_env(), capture_output=True,
                          text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return torch.load(out)


@pytest.mark.parametrize(("nodes", "nproc", "every", "local_comm", "overlap"),
                         [(2, 1, 1, "auto", "0"), (3, 1, 3, "auto", "0"), (2, 2, 2, "auto", "0"),
                          (2, 2, 4, "gloo", "0"), (3, 1, 1, "auto", "1"), (2, 2, 2, "auto", "1"),
                          (2, 2, 2, "gloo", "1")])
def test_nodes_fed_identical_batches_end_as_one_node_alone(nodes, nproc, every, local_comm, overlap, one_node,
                                                           tmp_path):
    """Outer lr 1, momentum 0: the outer step is the nodes' average, so nodes that saw the same
    batches end where one node alone does, whether a node is one rank or two (shared memory or
    Gloo within the node), at H = 1 and H > 1, and with the outer syncs overlapping the next phase
    (each node rebased on theta_global when the sync lands, at the next boundary or mid-phase:
    the same weights, as the nodes agree):
    the outer sync's own communication is exact. (Not bit for bit: theta_global - (theta_global -
    theta_n) rounds, and Adam's small eps turns the embeddings' tiniest gradients' rounding into
    visible steps: the N-rank tests' tolerance.)"""
    out = tmp_path / "params.pt"
    assert_ok(run_nodes(nodes, [WORKER, "identical", str(out), str(every)], nproc,
                        {"LOCAL_COMM": local_comm, "OVERLAP": overlap}))
    got = torch.load(out)
    assert got.keys() == one_node.keys() and len(got) > 10
    for name, ref in one_node.items():
        torch.testing.assert_close(got[name], ref, rtol=1e-4, atol=2e-5, msg=f"{name}: {nodes} nodes, H={every}")


def test_outer_step_is_the_token_weighted_nesterov_update(tmp_path):
    """Different batches on 3 nodes taking 1, 2 and 3 rows: theta_global after each of two outer
    steps is what the outer update defines, the nodes' deltas weighted 1/6, 2/6, 3/6."""
    rows = [1, 2, 3]
    assert_ok(run_nodes(3, [WORKER, "weighted", str(tmp_path), ",".join(map(str, rows))]))
    lr, mu = OUTER_LR, OUTER_MOMENTUM
    momentum: dict[str, torch.Tensor] = {}
    for k in range(2):
        before, after = torch.load(tmp_path / f"global.{k}.pt"), torch.load(tmp_path / f"global.{k + 1}.pt")
        inner = [torch.load(tmp_path / f"node{n}.{k}.pt") for n in range(3)]
        for name, theta in before.items():
            delta = sum(w / sum(rows) * (theta - node[name]) for w, node in zip(rows, inner, strict=True))
            momentum[name] = mu * momentum.get(name, torch.zeros_like(theta)) + delta
            expected = theta - lr * (delta + mu * momentum[name])
            torch.testing.assert_close(after[name], expected, rtol=1e-5, atol=1e-6, msg=f"{name}, outer step {k}")
        # the nodes really trained apart: their parameters differ before the sync
        assert not torch.equal(inner[0]["lm_head.weight"], inner[2]["lm_head.weight"])


def flat(params: dict[str, torch.Tensor], length: int) -> torch.Tensor:
    """The parameters as the outer step lays them out: one vector in the model's order, zero-padded."""
    values = torch.cat([t.reshape(-1) for t in params.values()])
    return torch.nn.functional.pad(values, (0, length - values.numel()))


@pytest.mark.parametrize(("compress", "exact_last"), [("int8", False), ("int4", True)])
def test_compressed_outer_steps_send_quantized_deltas_and_updates_with_error_feedback(compress, exact_last, tmp_path):
    """Different batches on 3 nodes taking 1, 2 and 3 rows, outer lr 0.7 and Nesterov 0.9, both
    halves of two outer syncs quantized: theta_global after each is what the codec defines (each
    node's weighted delta plus its residual quantized per slice, the owners' updates plus theirs
    quantized and added alike on every node), each leader's residuals are what the recurrence
    leaves, and the result is not the uncompressed update's. Sent as a run's last sync, the second
    carries the residuals in fp32 instead, and none is left."""
    rows = [1, 2, 3]
    assert_ok(run_nodes(3, [WORKER, "weighted", str(tmp_path), ",".join(map(str, rows))],
                        env_extra={"COMPRESS": compress, "EXACT_LAST": "1" if exact_last else "0"}))
    codec, lr, mu = codec_named(compress), OUTER_LR, OUTER_MOMENTUM
    start = torch.load(tmp_path / "global.0.pt")
    numel = sum(t.numel() for t in start.values())
    shard = -(-numel // 3)
    theta, momentum = flat(start, 3 * shard), torch.zeros(3 * shard)
    residuals, update_residuals = [torch.zeros(3 * shard) for _ in rows], [torch.zeros(shard) for _ in rows]
    for k in range(2):
        exact = exact_last and k == 1
        received = []
        for n, w in enumerate(rows):
            delta = torch.sub(theta, flat(torch.load(tmp_path / f"node{n}.{k}.pt"), 3 * shard)).mul_(w / sum(rows))
            if exact:
                received.append(delta.add_(residuals[n]).view(3, shard))
                residuals[n].zero_()
            else:
                received.append(codec.decode(send_with_feedback(codec, delta.view(3, shard), residuals[n]), shard))
        updates, plain = [], []
        for owner in range(3):
            mine = [r[owner] for r in received]
            summed = torch.sum(torch.stack(mine), dim=0, dtype=torch.float32) if exact else torch.zeros(shard)
            for r in mine if not exact else []:
                summed.add_(r)
            m = momentum[owner * shard: (owner + 1) * shard].mul_(mu).add_(summed)
            step = summed.add_(m, alpha=mu).mul_(-lr)
            plain.append(step.clone())
            if exact:
                updates.append(step.add_(update_residuals[owner]).view(1, shard))
                update_residuals[owner].zero_()
            else:
                updates.append(codec.decode(send_with_feedback(codec, step.view(1, shard), update_residuals[owner]),
                                            shard))
        got = flat(torch.load(tmp_path / f"global.{k + 1}.pt"), 3 * shard)
        expected = (theta.view(3, shard) + torch.cat(updates)).view(-1) if exact else \
            theta + torch.cat(updates, dim=1).view(-1)
        torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=f"outer step {k}")
        if not exact:
            assert not torch.allclose(got, theta + torch.cat(plain), rtol=1e-5, atol=1e-7)  # it was quantized
        theta = got
        for n in range(3):
            state = torch.load(tmp_path / f"state{n}.{k}.pt")
            assert torch.equal(state["residual"], residuals[n][:numel])
            assert torch.equal(state["update_residual"], update_residuals[n])
            assert (state["residual"].abs().max() > 0) != exact


def test_nodes_fed_identical_batches_end_within_a_quantum_of_one_node_alone_with_int8(one_node, tmp_path):
    """As the test above, with the one outer sync at the end quantized to int8 both ways: each
    parameter lands within a quantum of the largest delta (half of one per half) of where one node
    alone does."""
    out = tmp_path / "params.pt"
    assert_ok(run_nodes(3, [WORKER, "identical", str(out), "4"], env_extra={"COMPRESS": "int8"}))
    got, start = torch.load(out), torch.load(out.with_suffix(".start.pt"))
    moved = max(float((one_node[name] - start[name]).abs().max()) for name in start)
    worst = max(float((got[name] - one_node[name]).abs().max()) for name in start)
    assert 0 < worst <= moved / 127 * 1.01, (worst, moved)


def test_overlapped_outer_steps_land_one_phase_late_as_the_update_defines(tmp_path):
    """Different batches on 3 nodes taking 1, 2 and 3 rows, outer lr 0.7 and Nesterov 0.9, the first
    two outer steps overlapped: each node trains on from its own weights while a sync crosses, and
    when it lands the node's weights are its progress since plus the theta_global it brought. The
    final weights (the third outer step blocks) are what that recurrence gives from each node's
    weights before each outer step; plain DiLoCo's would differ."""
    rows = [1, 2, 3]
    assert_ok(run_nodes(3, [WORKER, "overlapped", str(tmp_path), ",".join(map(str, rows))]))
    lr, mu = OUTER_LR, OUTER_MOMENTUM
    theta = torch.load(tmp_path / "global.0.pt")
    base = [dict(theta) for _ in rows]  # the weights each node's phase began from
    momentum = {name: torch.zeros_like(t) for name, t in theta.items()}
    for k in range(3):
        before = [torch.load(tmp_path / f"node{n}.{k}.pt") for n in range(3)]
        new_theta = {}
        for name in theta:
            rebased = [node[name] - b[name] + theta[name] for node, b in zip(before, base, strict=True)]
            delta = sum(w / sum(rows) * (theta[name] - r) for w, r in zip(rows, rebased, strict=True))
            momentum[name] = mu * momentum[name] + delta
            new_theta[name] = theta[name] - lr * (delta + mu * momentum[name])
            for b, r in zip(base, rebased, strict=True):
                b[name] = r
        theta = new_theta
        assert not torch.equal(before[0]["lm_head.weight"], before[2]["lm_head.weight"])
    got = torch.load(tmp_path / "global.3.pt")
    for name, expected in theta.items():
        torch.testing.assert_close(got[name], expected, rtol=1e-5, atol=1e-5, msg=name)


def test_an_overlapped_sync_landing_mid_phase_rebases_each_node_on_the_theta_global_it_brought(tmp_path):
    """Two nodes of two ranks stepping through Gloo (the landing broadcasts the rebased weights),
    2 and 4 rows of different batches, outer lr 0.7 and Nesterov 0.9, the first two outer steps
    overlapped and landing one inner step after they leave. At each landing a node's weights
    become its weights then, less those it sent from, plus the theta_global the sync brought;
    each delta is then the progress since, and the final weights (the third outer step blocks)
    are what that recurrence gives. Identical batches would not tell this from a wrong rebase."""
    rows = [2, 4]
    assert_ok(run_nodes(2, [WORKER, "overlapped-mid", str(tmp_path), ",".join(map(str, rows))], nproc=2,
                        env_extra={"LOCAL_COMM": "gloo"}))
    lr, mu = OUTER_LR, OUTER_MOMENTUM
    theta = torch.load(tmp_path / "global.0.pt")
    momentum = {name: torch.zeros_like(t) for name, t in theta.items()}
    for k in range(3):
        before = [torch.load(tmp_path / f"node{n}.{k}.pt") for n in range(2)]
        new_theta = {}
        for name in theta:
            delta = sum(w / sum(rows) * (theta[name] - node[name]) for w, node in zip(rows, before, strict=True))
            momentum[name] = mu * momentum[name] + delta
            new_theta[name] = theta[name] - lr * (delta + mu * momentum[name])
        if k < 2:
            for n in range(2):
                mid, landed = (torch.load(tmp_path / f"node{n}.{k}.{when}.pt") for when in ("mid", "landed"))
                assert not torch.equal(mid["lm_head.weight"], before[n]["lm_head.weight"])  # it trained on
                for name in theta:
                    torch.testing.assert_close(landed[name], mid[name] - before[n][name] + new_theta[name],
                                               rtol=1e-5, atol=1e-5, msg=f"node {n} landing {k}: {name}")
        theta = new_theta
    got = torch.load(tmp_path / "global.3.pt")
    for name, expected in theta.items():
        torch.testing.assert_close(got[name], expected, rtol=1e-5, atol=1e-5, msg=name)


def test_the_overlapped_syncs_thread_stops_every_rank_when_a_nodes_theta_global_diverged():
    results = run_nodes(2, [WORKER, "diverge-overlapped"], nproc=2)
    out = "".join(o for _, o in results)
    assert all(code != 0 for code, _ in results), out
    assert "theta_global agrees" not in out
    assert re.search(r"theta_global diverged across nodes after outer step 2 \(overlapped, from step 2\): node 1 "
                     r"\(rank 2@\S+\) differs from node 0's", out), out


def test_checksum_guard_stops_every_rank_when_a_nodes_theta_global_diverged():
    results = run_nodes(2, [WORKER, "diverge"], nproc=2)
    out = "".join(o for _, o in results)
    assert all(code != 0 for code, _ in results), out
    assert "parameters agree" not in out
    assert re.search(r"parameters diverged across ranks at step 1: rank 2@\S+ differs from rank 0@\S+ first at "
                     r"'blocks\.1\.mlp\.c_fc\.weight'", out), out


# ---- the trainer ----------------------------------------------------------------------------------

@pytest.mark.parametrize("compress", ["none", "int4"])
def test_trainer_local_steps_resume_reproduces_losses(compress, tiny_data_dir, tiny_tokenizer_dir, tmp_path):
    """Two nodes at H = 4, checkpoints due every 2 steps: they are taken at the outer boundaries
    only (theta_global, the outer momentum, with --outer-compress each leader's residuals), and a
    run that died in an inner phase resumes from the last boundary with the uninterrupted run's
    losses."""
    def flags(node: int) -> list[str]:
        return train_target(*tiny_flags(tiny_data_dir, tiny_tokenizer_dir, tmp_path / f"n{node}", sync_every=4,
                                        checkpoint_every=2, keep_checkpoints=5, sync_warmup_ratio=0,
                                        outer_compress=compress))

    first = two_nodes(flags)
    full = losses(first)
    assert sorted(full) == list(range(1, 13))
    assert re.findall(r"outer step (\d) at step (\d+)", first) == [("1", "00004"), ("2", "00008"), ("3", "00012")]
    assert "local steps: node 0 of 2 (ranks [0]), 50.0% of each inner step's tokens" in first
    if compress != "none":
        assert "(int4, a scale per 32 values, with error feedback, --outer-compress int4)" in first
        last = re.search(r"outer step 3 at step 00012: .*", first).group(0)
        assert "(the run's last: --outer-compress int4 sends it in --grad-comm-dtype and --param-comm-dtype" in last
        saved = RunState.of_rank_file(torch.load(tmp_path / "n1" / "checkpoints" / "step_000008" / "rank1.pt"))
        assert saved.outer["residual"].abs().max() > 0
    for node in range(2):
        saved = sorted(p.name for p in (tmp_path / f"n{node}" / "checkpoints").iterdir())
        assert saved == ["step_000004", "step_000008", "step_000012"]
    final = torch.load(tmp_path / "n0" / "checkpoints" / "step_000012" / "model.pt")
    # both nodes died in the inner phase after step 8: the boundary at 8 is the newest checkpoint
    for node in range(2):
        for step in ("step_000012",):
            for f in (tmp_path / f"n{node}" / "checkpoints" / step).iterdir():
                f.unlink()
            (tmp_path / f"n{node}" / "checkpoints" / step).rmdir()
    second = two_nodes(flags)
    assert "resumed from checkpoint step 8" in second
    resumed = losses(second)
    assert sorted(resumed) == [9, 10, 11, 12]
    for step, loss in resumed.items():
        assert loss == pytest.approx(full[step], abs=1e-4), f"step {step}: {loss} vs uninterrupted {full[step]}"
    # and the model they end with: the last sync sends what the residuals resumed from step 8 owed
    again = torch.load(tmp_path / "n0" / "checkpoints" / "step_000012" / "model.pt")
    for name, tensor in final.items():
        torch.testing.assert_close(again[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("compress", ["none", "int4"])
def test_trainer_overlapped_syncs_land_mid_phase_and_a_resume_from_a_whole_boundary_reproduces_losses(
        compress, tiny_data_dir, tiny_tokenizer_dir, tmp_path):
    """Two nodes at H = 2 with --outer-overlap on and a checkpoint due every 6 steps. The first sync
    (step 2) blocks and is timed: it sets how many inner steps a sync is given to cross. Those at 4,
    8 and 10 cross in the background and land then (mid-phase, or at the next boundary where that
    is H); those at 6 and 12 block, so that the checkpoints hold theta_global and nothing in
    flight. A run that died after step 6 resumes from it, with the landing the first run timed,
    and repeats the uninterrupted run's losses; also with the syncs quantized (the codec runs in
    the sync's thread, the residuals wait in the checkpoint)."""
    def flags(node: int) -> list[str]:
        return train_target(*tiny_flags(tiny_data_dir, tiny_tokenizer_dir, tmp_path / f"n{node}", sync_every=2,
                                        outer_overlap="on", checkpoint_every=6, sync_warmup_ratio=0,
                                        outer_compress=compress))

    first = two_nodes(flags)
    full = losses(first)
    assert sorted(full) == list(range(1, 13))
    assert "each crosses in the background of the next inner steps (--outer-overlap on)" in first
    after = int(re.search(r"outer-overlap: each outer sync lands (\d+) inner steps after it leaves \(outer sync", first)
                .group(1))
    assert after in (1, 2), first
    lines = dict(re.findall(r"outer step \d+ at step (\d+): .*? H=2 (.*)", first))
    assert sorted(lines) == ["00002", "00004", "00006", "00008", "00010", "00012"], first
    for step in ("00002", "00006", "00012"):
        assert lines[step].startswith("pseudo_grad_norm="), lines[step]
    for step in (4, 8, 10):
        assert lines[f"{step:05d}"].startswith("overlapped: it crosses in the background and lands at "), first
        if after == 1:  # mid-phase: its own line
            assert re.search(rf"outer step \d+ landed at step {step + 1:05d}: after [\d.]+s in the background", first)
    if after == 2:  # at the next boundary; where that one blocks, its line says what landed first
        assert "the one before landed here after" in lines["00010"], first
        for step, number in (("00006", 2), ("00012", 5)):
            assert re.search(rf"; outer step {number} landed first, after [\d.]+s in the background, "
                             r"pseudo_grad_norm=\d", lines[step]), first
    for node in range(2):
        step_dir = tmp_path / f"n{node}" / "checkpoints" / "step_000012"
        for f in step_dir.iterdir():
            f.unlink()
        step_dir.rmdir()
    second = two_nodes(flags)
    assert "resumed from checkpoint step 6" in second
    assert "outer-overlap: each outer sync lands" not in second  # the first run's timing stands
    resumed = losses(second)
    assert sorted(resumed) == list(range(7, 13))
    for step, loss in resumed.items():
        assert loss == pytest.approx(full[step], abs=1e-4), f"step {step}: {loss} vs uninterrupted {full[step]}"


@pytest.mark.parametrize("overlap", ["auto", "on"])
def test_trainer_auto_picks_one_h_on_every_rank_of_two_two_rank_nodes(overlap, tiny_data_dir, tiny_tokenizer_dir,
                                                                      tmp_path):
    """Overlapped, auto times its first outer sync blocking all the same, and then needs only the
    phase that sync takes to cross (and its own work held to 5%): every rank picks the same H.
    With --outer-overlap auto, rank 3's steps 0.3 s longer (a loopback sync is then short against
    them for certain, as on a fast link): every rank blocks."""
    flags = tiny_flags(tiny_data_dir, tiny_tokenizer_dir, tmp_path, sync_every="auto", sync_warmup_ratio=0,
                       checkpoint_every=0, total_batch_size=512, outer_overlap=overlap)
    if overlap == "auto":
        results = run_nodes(2, [SLOW_TRAIN, *flags], nproc=2, env_extra={"SLOW_S": "0.3", "SLOW_RANK": "3"})
    else:
        results = run_nodes(2, train_target(*flags), nproc=2)
    out = assert_ok(results)
    chosen = re.findall(r"rank (\d)/4\] sync-every auto: H=(\d+) \(outer sync [0-9.]+ s, ([^)]*)", out)
    assert sorted(r for r, _, _ in chosen) == ["0", "1", "2", "3"] and len({h for _, h, _ in chosen}) == 1, out
    overlapped = {"s of it this node's own work" in why for _, _, why in chosen}
    assert overlapped == {overlap == "on"}, out
    if overlap == "auto":
        decided = re.findall(r"rank (\d)/4\] outer-overlap auto: a blocking sync of .*: blocking$", out, re.M)
        assert sorted(decided) == ["0", "1", "2", "3"], out
        assert "overlapped: it crosses in the background" not in out
    assert out.count("share parameters, gradients and optimizer state") == 4  # within each node: shared memory
    assert "eval step 00012 val_bpb=" in out


def test_outer_overlap_auto_overlaps_where_a_blocking_sync_would_hold_the_nodes_and_a_resume_keeps_it(
        tiny_data_dir, tiny_tokenizer_dir, tmp_path):
    """Every outer sync's exchange sleeps 2 s more (slow_compute_train's OUTER_WIRE_S) against inner
    steps of ~0.2 s (node 1's compute): blocking, auto would need H ~190 for 5%, past its cap, so
    --outer-overlap auto times the first sync (blocking), chooses to overlap the next ones, and H
    from the steps they take to cross (~14). They cross in the background; the one after the
    checkpoint due at 35 and the last block. A run resumed from that checkpoint keeps the choice,
    overlaps again (at any H from 8 to 22 a sync between it and step 70 is not whole) and
    repeats the uninterrupted losses."""
    def nodes_out() -> str:
        port, env = free_port(), {**node_env(), "SLOW_S": "0.2", "SLOW_RANK": "1", "SLOW_BUSY": "1",
                                  "OUTER_WIRE_S": "2"}
        flags = [[SLOW_TRAIN, *tiny_flags(tiny_data_dir, tiny_tokenizer_dir, tmp_path / f"n{node}", sync_every="auto",
                                          outer_overlap="auto", num_iterations=70, sync_warmup_ratio=0,
                                          checkpoint_every=35)] for node in range(2)]
        return assert_ok(collect([spawn_node(2, n, port, flags[n], env=env) for n in range(2)], 240))

    first = nodes_out()
    assert "--outer-overlap auto: the syncs cross in the background of the next inner steps where" in first
    decided = re.findall(r"outer-overlap auto: a blocking sync of 2\.\d\d s against 0\.\d\d-s inner steps is "
                         r"\d+% of the wall time at H = 100 \(auto's cap\); overlapped, .* at H = (\d+): overlapped$",
                         first, re.M)
    assert len(decided) == 2 and len(set(decided)) == 1, first  # every rank alike
    h = int(re.search(r"sync-every auto: H=(\d+) \(outer sync", first).group(1))
    assert 8 <= h <= 22 and h == int(decided[0]), first
    assert re.search(r"outer step 2 at step \d+: .* overlapped: it crosses in the background", first), first
    assert re.search(r"outer step \d+ at step 00070: .* pseudo_grad_norm=", first), first  # the last one blocks
    full = losses(first)
    assert sorted(full) == list(range(1, 71))
    saved = [sorted((tmp_path / f"n{node}" / "checkpoints").glob("step_*")) for node in range(2)]
    for step_dir in [d for dirs in saved for d in dirs[1:]]:  # the run ends after its first checkpoint
        for f in step_dir.iterdir():
            f.unlink()
        step_dir.rmdir()
    second = nodes_out()
    assert f"resumed from checkpoint step {int(saved[0][0].name.removeprefix('step_'))}" in second, second
    assert "outer-overlap auto:" not in second, second
    assert "overlapped: it crosses in the background" in second, second
    for step, loss in losses(second).items():
        assert loss == pytest.approx(full[step], abs=1e-4), f"step {step}: {loss} vs uninterrupted {full[step]}"


def test_auto_times_the_sync_of_the_last_node_to_arrive_not_the_wait_for_it(tiny_data_dir, tiny_tokenizer_dir,
                                                                             tmp_path):
    """A node that arrives late at the first outer sync makes the others wait inside it; that wait
    is the inner phases' imbalance, which a longer H does not spread thinner. auto must choose H
    from the late node's sync, the wire's own time, or it picks an H far past what the link needs."""
    flags = tiny_flags(tiny_data_dir, tiny_tokenizer_dir, tmp_path, sync_every="auto", sync_warmup_ratio=0,
                       checkpoint_every=0)
    results = run_nodes(2, [LATE_TRAIN, *flags], env_extra={"LATE_RANK": "1", "LATE_S": "4"})
    out = assert_ok(results)
    assert "LATE: rank 1 sleeps 4 s" in out
    first = {int(r): float(s) for r, s in re.findall(r"rank (\d)/2\] outer step 1 at step \d+: sync_s=([0-9.]+)", out)}
    assert first[0] >= 2.5 > first[1], out  # rank 0 waited for rank 1 inside the sync (less its own lag)
    chosen = re.findall(r"sync-every auto: H=\d+ \(outer sync ([0-9.]+) s", out)
    assert len(chosen) == 2 and {float(c) for c in chosen} == {first[1]}, out


def test_auto_keeps_every_step_synchronous_where_the_wire_is_cheap_also_on_resume(tiny_data_dir,
                                                                                   tiny_tokenizer_dir, tmp_path):
    """Node 1's steps take a second longer to compute: node 0 waits for it most of each step, node 1
    a few milliseconds on loopback, which is the wire's own time: under 5%, so local steps have
    nothing to win (auto must take the last node's share, not the waiting one's). auto times the
    warm-up's steps 2-3 (--sync-warmup-ratio 0.25 of 12), keeps every step synchronous and says
    why; the checkpoints' markers carry the choice, so a run resumed from step 8 keeps it too and
    repeats the uninterrupted run's losses."""
    def nodes_out() -> str:
        port, env = free_port(), {**node_env(), "SLOW_S": "1", "SLOW_RANK": "1"}
        flags = [[SLOW_TRAIN, *tiny_flags(tiny_data_dir, tiny_tokenizer_dir, tmp_path / f"n{node}", sync_every="auto",
                                          sync_warmup_ratio=0.25, checkpoint_every=4, keep_checkpoints=3)]
                 for node in range(2)]
        return assert_ok(collect([spawn_node(2, n, port, flags[n], env=env) for n in range(2)], 240))

    first = nodes_out()
    kept = re.findall(r"rank \d/2\] sync-every auto: (synchronous steps waited [0-9.]+% of their time on the wire "
                      r"in the warm-up \(the last rank to arrive\), at most 5%: every step stays synchronous)", first)
    assert len(kept) == 2 and len(set(kept)) == 1, first
    assert "outer step" not in first and "local steps: node" not in first and "warm-up done" not in first, first
    full = losses(first)
    assert sorted(full) == list(range(1, 13))
    for node in range(2):
        ckpts = tmp_path / f"n{node}" / "checkpoints"
        assert sorted(p.name for p in ckpts.iterdir()) == ["step_000004", "step_000008", "step_000012"]
        marker = json.loads((ckpts / "step_000008" / "COMPLETE").read_text())
        assert marker["auto_choice"] == {"synchronous": True, "why": kept[0]} and not marker["local_steps"]
        for f in (ckpts / "step_000012").iterdir():
            f.unlink()
        (ckpts / "step_000012").rmdir()
    second = nodes_out()
    assert f"every step stays synchronous, as chosen before checkpoint 8 ({kept[0]})" in second, second
    assert "outer step" not in second and "local steps" not in second, second
    resumed = losses(second)
    assert sorted(resumed) == list(range(9, 13))
    for step, loss in resumed.items():
        assert loss == pytest.approx(full[step], abs=1e-4), f"step {step}: {loss} vs uninterrupted {full[step]}"


def test_auto_times_a_synchronous_checkpoint_it_never_decided_on_before_choosing(tiny_data_dir, tiny_tokenizer_dir,
                                                                                  tmp_path):
    """A run trained with --sync-every 1 (train.yml's default before auto), resumed from step 4 under
    auto: nothing says what auto would choose, so steps 5-7 stay synchronous and are timed (6-7:
    the process's first is not), and only then does auto choose (here: synchronous, node 1 being
    slow to compute); the losses are the synchronous run's."""
    def nodes_out(every: str) -> str:
        port, env = free_port(), {**node_env(), "SLOW_S": "1", "SLOW_RANK": "1"}
        flags = [[SLOW_TRAIN, *tiny_flags(tiny_data_dir, tiny_tokenizer_dir, tmp_path / f"n{node}", sync_every=every,
                                          checkpoint_every=4, keep_checkpoints=3)] for node in range(2)]
        return assert_ok(collect([spawn_node(2, n, port, flags[n], env=env) for n in range(2)], 240))

    full = losses(nodes_out("1"))
    for node in range(2):
        for step in ("step_000008", "step_000012"):
            for f in (tmp_path / f"n{node}" / "checkpoints" / step).iterdir():
                f.unlink()
            (tmp_path / f"n{node}" / "checkpoints" / step).rmdir()
    second = nodes_out("auto")
    assert "sync-every auto: checkpoint 4 has synchronous steps that auto has not timed: steps 5-7 synchronous, " \
           "then auto chooses" in second, second
    assert re.search(r"sync-every auto: synchronous steps waited [0-9.]+% .* every step stays synchronous", second)
    assert "outer step" not in second and "local steps: node" not in second, second
    resumed = losses(second)
    assert sorted(resumed) == list(range(5, 13))
    for step, loss in resumed.items():
        assert loss == pytest.approx(full[step], abs=1e-4), f"step {step}: {loss} vs synchronous {full[step]}"


def test_a_synchronous_checkpoint_resumed_with_local_steps_keeps_its_split_and_checks_it_again(
        tiny_data_dir, tiny_tokenizer_dir, tmp_path):
    """A run of synchronous steps whose split was measured and checked (settled), restarted at its
    checkpoint 4 with --sync-every 4: the same ranks keep the split, but the inner steps run at
    other speeds than synchronous ones (each node's optimizer on the whole model, no wire), so
    the split is checked again against them (steps 6-7: the first allocates)."""
    def nodes_out(every: int, iterations: int) -> str:
        port = free_port()
        flags = [train_target(*tiny_flags(tiny_data_dir, tiny_tokenizer_dir, tmp_path / f"n{node}", sync_every=every,
                                          sync_warmup_ratio=0, rank_batch_sizes="auto", num_iterations=iterations,
                                          checkpoint_every=4)) for node in range(2)]
        return assert_ok(collect([spawn_node(2, n, port, flags[n]) for n in range(2)], 240))

    first = nodes_out(1, 4)
    split = re.search(r"work split checked against steps to 3: .* -> rows \[(\d+), (\d+)\]", first)
    assert split, first
    sizes = f"[{split.group(1)}, {split.group(2)}]"
    second = nodes_out(4, 12)
    assert "resumed step 4" in second and f"work split from the checkpoint: {sizes}" in second, second
    assert re.search(r"work split checked against steps to 7: ", second), second


def test_auto_ends_the_warm_up_early_on_a_slow_wire_and_a_resume_keeps_that_end(tiny_data_dir, tiny_tokenizer_dir,
                                                                                  tmp_path):
    """Every synchronous step waits 0.1 s more on the wire (slow_compute_train's WIRE_S) and node 1
    computes 0.5 s a step: --sync-warmup-ratio 0.75 of 40 steps plans 30 synchronous steps, whose
    waits would be about 3 s of a run of about 20 s. auto, having timed steps 2-3, chooses local
    steps and ends the warm-up where its waits fit in 5% of the run (about step 10), says so, and
    the checkpoints' markers carry that end: a run resumed inside the shortened warm-up ends it at
    the same step and repeats the uninterrupted run's losses."""
    def nodes_out() -> str:
        port, env = free_port(), {**node_env(), "SLOW_S": "0.5", "SLOW_RANK": "1", "WIRE_S": "0.1"}
        flags = [[SLOW_TRAIN, *tiny_flags(tiny_data_dir, tiny_tokenizer_dir, tmp_path / f"n{node}", sync_every="auto",
                                          num_iterations=40, sync_warmup_ratio=0.75, checkpoint_every=4,
                                          keep_checkpoints=20)] for node in range(2)]
        return assert_ok(collect([spawn_node(2, n, port, flags[n], env=env) for n in range(2)], 240))

    first = nodes_out()
    assert re.search(r"sync-every auto: synchronous steps waited [0-9.]+% .* over 5%: local steps follow", first)
    cut = re.search(r"sync-every auto: the synchronous warm-up ends at step (\d+) instead of 30 \(each synchronous "
                    r"step waits 0\.1\d s on the wire, and 5% of the run's ~\d+s \(40 steps of ~0\.\d\d s once "
                    r"local\) buys \d+\)", first)
    assert cut, first
    end = int(cut.group(1))
    assert 5 <= end < 30, first  # 5% of 40 steps of ~0.5 s is ~1 s: ~10 waits of 0.1 s
    assert f"synchronous warm-up done at step {end} " in first, first
    # the first outer sync comes as many inner steps later as the warm-up's wire wait asks for
    # (0.1 s against 0.5-s steps: 4), not after AUTO_FIRST_PHASE steps, and is timed for H
    first_sync = re.search(r"sync-every auto: the first outer sync after (\d+) inner steps \(a synchronous step "
                           r"waited 0\.1\d s on the wire against 0\.\d\d s of work, and an outer sync sends as "
                           r"much\); its own time sets H", first)
    assert first_sync and int(first_sync.group(1)) > AUTO_FIRST_PHASE, first
    phase = int(first_sync.group(1))
    assert f"outer step 1 at step {end + phase:05d}:" in first and "sync-every auto: H=" in first, first
    full = losses(first)
    assert sorted(full) == list(range(1, 41))
    inside = max(step for step in range(4, end, 4))  # a checkpoint inside the shortened warm-up
    for node in range(2):
        ckpts = tmp_path / f"n{node}" / "checkpoints"
        marker = json.loads((ckpts / f"step_{inside:06d}" / "COMPLETE").read_text())
        assert marker["auto_choice"]["warm_until"] == end and not marker["auto_choice"]["synchronous"]
        for later in [p for p in ckpts.iterdir() if int(p.name.removeprefix("step_")) > inside]:
            for f in later.iterdir():
                f.unlink()
            later.rmdir()
    second = nodes_out()
    assert f"sync-every auto: local steps, as chosen before checkpoint {inside} (" in second, second
    assert f"local steps after a synchronous warm-up: steps {inside + 1}-{end} synchronous (as auto chose)" in second
    assert f"synchronous warm-up done at step {end} " in second, second
    resumed = losses(second)
    assert sorted(resumed) == list(range(inside + 1, 41))
    # H is chosen again from the first outer sync's timing, a few loopback milliseconds that may
    # round to another H: the losses repeat to that sync, and past it where both chose alike
    assert f"outer step 1 at step {end + phase:05d}:" in second, second
    same_h = re.findall(r"sync-every auto: H=(\d+) ", first) == re.findall(r"sync-every auto: H=(\d+) ", second)
    for step, loss in resumed.items():
        if step <= end + phase or same_h:
            assert loss == pytest.approx(full[step], abs=1e-4), f"step {step}: {loss} vs uninterrupted {full[step]}"


def test_a_checkpoint_reaches_every_disk_while_the_inner_steps_go_on_and_a_kill_mid_way_loses_nothing(
        tiny_data_dir, tiny_tokenizer_dir, tmp_path):
    """With local steps a checkpoint crosses to the other disks in the background, the wire being
    idle between outer syncs. Here each crosses in about 200 rounds of 8 KiB, each 0.02 s slower
    than loopback (tests/entry_points/slow_checkpoint_train.py): 4 s, against inner steps of 20 ms. The steps go on
    meanwhile, the next checkpoint waits for it (and says so), every disk ends with the same
    bytes. A node killed while checkpoint 8 is crossing leaves it unsealed everywhere, and the
    run resumes from checkpoint 4 and repeats the uninterrupted run's losses: nothing is lost
    that a checkpoint had sealed, nothing unsealed is resumed. torchrun's 5 s for a stop is less
    than two such checkpoints: the run says so once, when it has timed one."""
    env = {**node_env(), "CHUNK_BYTES": "8192", "ROUND_S": "0.02", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "5"}

    def start(run: str) -> list[subprocess.Popen]:
        port = free_port()
        return [spawn_node(2, n, port, [SLOW_CHECKPOINT_TRAIN, *tiny_flags(
            tiny_data_dir, tiny_tokenizer_dir, tmp_path / run / f"n{n}", sync_every=4, sync_warmup_ratio=0,
            num_iterations=16, checkpoint_every=4, keep_checkpoints=5)], env=env) for n in range(2)]

    whole = assert_ok(collect(start("a"), 240))
    node0 = [line for line in whole.splitlines() if "rank 0/2]" in line]
    in_order = ["checkpoint step 4 taken: it reaches every disk in the background", "step 00005/",
                "checkpoint step 4 saved to", "step 8 waited"]  # the steps went on while it crossed
    at = [next((i for i, line in enumerate(node0) if what in line), -1) for what in in_order]
    assert -1 not in at and at == sorted(at), "\n".join(node0)
    assert re.search(r"checkpoint step 4 saved to \S+ in [0-9.]+s; [0-9.]+ MiB of 2 ranks' states in \d\d+ "
                     r"round\(s\), in the background of the inner steps", whole), whole
    assert re.search(r"checkpoint step 16 saved to \S+ in [0-9.]+s; [0-9.]+ MiB of 2 ranks' states in \d+ "
                     r"round\(s\)\n", whole), whole  # the last one while every rank waits
    warnings = re.findall(r"WARNING at step (\d+): a stop .* would take ~(\d+) s here: .* the checkpoint still "
                          r"crossing, then its own \((\d+) s each, as checkpoint step 4 took\), more than the 5 s "
                          r"torchrun gives .* -e trainer_graceful_stop_sec=60 -e trainer_stop_timeout_sec=90", whole)
    # both figures are rounded to whole seconds: 2 x 4.54 s is said as ~9 s, 4.54 s as 5 s
    assert len(warnings) == 1 and warnings[0][0] == "8" and int(warnings[0][1]) >= 2 * int(warnings[0][2]) - 1, whole
    runs = [tmp_path / "a" / f"n{n}" for n in range(2)]
    for n in range(2):
        assert checkpoint_files.complete_steps(str(runs[n])) == [4, 8, 12, 16]
    for f in (runs[0] / "checkpoints" / "step_000008").iterdir():
        assert f.read_bytes() == (runs[1] / "checkpoints" / "step_000008" / f.name).read_bytes(), f.name
    full = losses(whole)

    procs = start("b")
    read_until(procs[1], "checkpoint step 8 taken", timeout=120)
    seen = read_until(procs[1], "step 00009/", timeout=60)
    assert "checkpoint step 8 saved" not in seen, seen
    kill_tree(procs[1].pid, signal.SIGKILL)
    procs[1].wait(30)
    assert procs[0].wait(90) != 0
    for n in range(2):
        assert checkpoint_files.complete_steps(str(tmp_path / "b" / f"n{n}")) == [4]
    resumed = assert_ok(collect(start("b"), 240))
    assert "resumed from checkpoint step 4" in resumed, resumed
    again = losses(resumed)
    assert sorted(again) == list(range(5, 17))
    for step, loss in again.items():
        assert loss == pytest.approx(full[step], abs=1e-4), f"step {step}: {loss} vs uninterrupted {full[step]}"


def test_local_steps_start_after_a_synchronous_warm_up_and_resume_from_its_checkpoint(tiny_data_dir,
                                                                                      tiny_tokenizer_dir, tmp_path):
    """--sync-warmup-ratio 0.25 of 12 steps: steps 1-3 synchronous, a checkpoint at 3, then each node
    continues the whole synchronous optimizer state in inner phases of H = 4 (boundaries 7, 11 and
    the last step). A run resumed from the warm-up's checkpoint (a synchronous one, continued with
    local steps) repeats the uninterrupted run's losses: the switch in the run and the one on resume
    are the same."""
    def flags(node: int) -> list[str]:
        return train_target(*tiny_flags(tiny_data_dir, tiny_tokenizer_dir, tmp_path / f"n{node}", sync_every=4,
                                        sync_warmup_ratio=0.25, checkpoint_every=0, keep_checkpoints=5))

    first = two_nodes(flags)
    assert "local steps after a synchronous warm-up: steps 1-3 synchronous (--sync-warmup-ratio 0.25)" in first
    assert "synchronous warm-up done at step 3 (--sync-warmup-ratio 0.25)" in first
    assert re.findall(r"outer step (\d) at step (\d+)", first) == [("1", "00007"), ("2", "00011"), ("3", "00012")]
    full = losses(first)
    assert sorted(full) == list(range(1, 13))
    for node in range(2):
        ckpts = tmp_path / f"n{node}" / "checkpoints"
        assert sorted(p.name for p in ckpts.iterdir()) == ["step_000003", "step_000012"]
        for f in (ckpts / "step_000012").iterdir():  # back to the end of the warm-up
            f.unlink()
        (ckpts / "step_000012").rmdir()
    second = two_nodes(flags)
    assert "resumed step 3, written by 2 ranks" in second, second
    assert "local steps: node 0 of 2 (ranks [0]), 50.0% of each inner step's tokens; outer sync every 4 steps " \
           "from step 3" in second
    resumed = losses(second)
    assert sorted(resumed) == list(range(4, 13))
    for step, loss in resumed.items():
        assert loss == pytest.approx(full[step], abs=1e-4), f"step {step}: {loss} vs uninterrupted {full[step]}"


@pytest.mark.parametrize("wire_s", ["0.3", "0"])
def test_auto_decides_from_the_steps_before_a_new_split_where_they_ask_for_local_steps(
        tiny_data_dir, tiny_tokenizer_dir, tmp_path, wire_s):
    """Node 1 computes 1.5 s a step longer, which the calibration before step 0 does not see, so the
    check at step 3 gives node 0 more rows. The last node to arrive waited on the wire alone at the
    old split, and at the new one the slowest node works less: a share that asks for local steps
    (0.3 s of wire a step) asks for them still, so the warm-up ends at step 3 as planned and the
    local steps begin at 4 (before, auto timed two more synchronous steps). Where the wire is
    cheap the old split's steps would keep every step synchronous, which the new split might not:
    auto times two steps at the new split and decides at step 5 (loopback's wire is a few hundredths
    of a second against steps of 1.5 s and more). The rows are long enough that the calibration's
    passes (about 0.1 s) see the nodes as equally fast."""
    rows_that_cost = {"depth": 4, "aspect_ratio": 64, "max_seq_len": 256, "device_batch_size": 4,
                      "total_batch_size": 2048}
    port = free_port()
    env = {**node_env(), "SLOW_S": "1.5", "SLOW_RANK": "1", "WIRE_S": wire_s}
    flags = [[SLOW_TRAIN, *tiny_flags(tiny_data_dir, tiny_tokenizer_dir, tmp_path / f"n{node}", sync_every="auto",
                                      sync_warmup_ratio=0.25, rank_batch_sizes="auto", checkpoint_every=0,
                                      **rows_that_cost)]
             for node in range(2)]
    results = collect([spawn_node(2, n, port, flags[n], env=env) for n in range(2)], 240)
    out = assert_ok(results)[: len(results[0][1])]  # node 0's
    moved = re.search(r"work split checked against steps to 3: .* -> rows \[(\d+), (\d+)\] instead of \[(\d+), "
                      r"(\d+)\]", out)
    assert moved, out
    new, old = [int(moved.group(i)) for i in (1, 2)], [int(moved.group(i)) for i in (3, 4)]
    assert new[0] > max(new[1], old[0]), out
    if wire_s != "0":
        assert re.search(r"sync-every auto: synchronous steps waited [0-9.]+% .* over 5%: local steps follow", out)
        assert "synchronous warm-up done at step 3 " in out and "timing the new split" not in out, out
    else:
        assert re.search(r"sync-every auto: timed before the work split changed \(.*\); timing the new split", out)
        retimed = out[out.index("timing the new split"):]
        decided = re.search(r"sync-every auto: synchronous steps waited .*(every step stays synchronous|local steps "
                            r"follow)", retimed)
        assert decided, out
        assert "step 00005/" in retimed[: decided.start()] and "step 00006/" not in retimed[: decided.start()], out
    assert sorted(losses(out)) == list(range(1, 13))


def test_the_split_is_checked_again_when_the_local_steps_begin(tiny_data_dir, tiny_tokenizer_dir, tmp_path):
    """A node whose speed changes once the inner phases begin (on a shared host each node then runs
    its optimizer on the whole model and none waits on the wire): node 0 is the slow one in the
    warm-up (steps 1-3), node 1 from step 4, each by far more than the machine's load does to
    milliseconds of compute. The warm-up's check leaves node 0 no more rows than node 1; the check
    against the inner steps (5-6: the first one allocates the nodes' optimizers) gives node 0 more
    at once, in the middle of the first inner phase (H = 4: the outer sync at 7), which weighs each
    node by the rows it really did in it. The warm-up's checkpoint saves the split as not yet
    settled; the last one saves the new split, settled. A resume from the warm-up's checkpoint
    checks at the same step, comes to the same rows and repeats the losses."""
    port = free_port()
    env = {**node_env(), "SLOW_S": "0.5", "SLOW_RANK": "1", "SLOW_FROM": "4", "EARLY_RANK": "0", "EARLY_S": "0.5"}
    flags = [[SLOW_TRAIN, *tiny_flags(tiny_data_dir, tiny_tokenizer_dir, tmp_path / f"n{node}", sync_every=4,
                                      sync_warmup_ratio=0.25, rank_batch_sizes="auto", checkpoint_every=0,
                                      keep_checkpoints=5)] for node in range(2)]
    out = assert_ok(collect([spawn_node(2, n, port, flags[n], env=env) for n in range(2)], 240))
    assert "synchronous warm-up done at step 3" in out, out
    checks = re.findall(r"work split checked against steps to (\d+): .* -> rows \[(\d+), (\d+)\]", out)
    assert [step for step, *_ in checks] == ["3", "6"], out
    moved = re.search(r"work split checked against steps to 6: rank 0@\S+ \d+ ms/row, rank 1@\S+ \d+ ms/row -> "
                      r"rows \[(\d+), (\d+)\] instead of", out)
    assert moved and int(moved.group(1)) > int(moved.group(2)), out
    assert f"rows [{moved.group(1)}, {moved.group(2)}] x 64 tokens" in out, out
    assert re.findall(r"rank 0/2\] outer step (\d) at step (\d+)", out) == [("1", "00007"), ("2", "00011"),
                                                                         ("3", "00012")], out
    assert sorted(losses(out)) == list(range(1, 13))
    saved = RunState.of_rank_file(torch.load(tmp_path / "n0" / "checkpoints" / "step_000003" / "rank0.pt",
                                             weights_only=False))
    assert saved.split_settled is False
    final = RunState.of_rank_file(torch.load(tmp_path / "n0" / "checkpoints" / "step_000012" / "rank0.pt",
                                             weights_only=False))
    assert final.split_settled is True
    assert final.rank_batch_sizes == [int(moved.group(1)), int(moved.group(2))]
    for node in range(2):
        shutil.rmtree(tmp_path / f"n{node}" / "checkpoints" / "step_000012")
    again = assert_ok(collect([spawn_node(2, n, port, flags[n], env=env)
                               for n in range(2)], 240))
    assert "resumed step 3" in again, again
    assert re.search(rf"work split checked against steps to 6: .* -> rows \[{moved.group(1)}, {moved.group(2)}\] "
                     r"instead of", again), again
    for step, loss in losses(again).items():
        assert loss == pytest.approx(losses(out)[step], abs=1e-4), f"step {step}: {loss} vs uninterrupted"


def test_the_speed_verdict_waits_for_the_local_steps_after_the_warm_up(tiny_data_dir, tiny_tokenizer_dir, tmp_path):
    """Timings are said every 10 steps: at step 10, the warm-up's last, as the warm-up's speed only
    (a slow link makes it slower than one node, which is why local steps follow); the FASTER/SLOWER
    verdict comes from the local steps' timings, at the last step, as the run's `at the end:` line."""
    out = two_nodes(lambda node: train_target(*tiny_flags(tiny_data_dir, tiny_tokenizer_dir, tmp_path / f"n{node}",
                                                          sync_every=2, sync_warmup_ratio=0.8, checkpoint_every=0)))
    assert re.search(r"synchronous warm-up to step 10: cluster [0-9,]+ tok/s = [0-9.]+x what its fastest node "
                     r"would do alone \(est\.\); the speed verdict follows the local steps from step 10", out), out
    verdicts = [m.start() for m in re.finditer(r"(FASTER|SLOWER) THAN ONE NODE: cluster", out)]
    assert len(verdicts) == 1 and verdicts[0] > out.index("synchronous warm-up done at step 10"), out
    # the only verdict is the last step's: the run's summary (status.yml, make demo) reads it by its prefix
    assert re.search(r"\] at the end: (FASTER|SLOWER) THAN ONE NODE: cluster", out), out


def test_the_runs_verdict_is_every_local_steps_means_not_its_last_short_phase(tiny_data_dir, tiny_tokenizer_dir,
                                                                             tmp_path):
    """Every outer sync waits 1 s more (OUTER_WIRE_S) at H = 10 of 12 steps: the last phase is two
    steps and a sync, 0.5 s of wait a step, where over the run the two syncs are 2 s over 12. The
    last timing line, which the run's `at the end:` verdict reads, is the run's means."""
    port, env = free_port(), {**node_env(), "SLOW_S": "0", "SLOW_RANK": "1", "OUTER_WIRE_S": "1"}
    flags = [[SLOW_TRAIN, *tiny_flags(tiny_data_dir, tiny_tokenizer_dir, tmp_path / f"n{node}", sync_every=10,
                                      sync_warmup_ratio=0, checkpoint_every=0)] for node in range(2)]
    out = assert_ok(collect([spawn_node(2, n, port, flags[n], env=env) for n in range(2)], 240))
    waits = {int(step): int(ms) for step, ms in
             re.findall(r"timing step (\d+): rank 0@\S+ compute_ms=\d+ comm_wait_ms=(\d+)", out)}
    assert sorted(waits) == [10, 12], out
    assert 100 <= waits[10] < 250, out  # 1 s over the phase's 10 steps
    assert 160 <= waits[12] < 350, out  # 2 s over 12 steps, not 1 s over 2
    assert re.search(r"\] at the end: (FASTER|SLOWER) THAN ONE NODE: cluster", out), out


def test_a_local_steps_checkpoint_is_not_resumed_synchronously(tiny_data_dir, tiny_tokenizer_dir, tmp_path):
    def flags(node: int, every: str) -> list[str]:
        return train_target(*tiny_flags(tiny_data_dir, tiny_tokenizer_dir, tmp_path / f"n{node}", sync_every=every,
                                        num_iterations=4, sync_warmup_ratio=0))

    port = free_port()
    procs = [spawn_node(2, n, port, flags(n, "4")) for n in range(2)]
    assert all(p.communicate(timeout=240)[0] is not None and p.returncode == 0 for p in procs)
    port = free_port()
    procs = [spawn_node(2, n, port, flags(n, "1")) for n in range(2)]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    assert all(p.returncode == 2 for p in procs), outs
    assert "was trained with local steps (--sync-every above 1 or auto, past its --sync-warmup-ratio), this run " \
           "asks for every step synchronous" in outs[0]


def lose_node_one(data, tok, tmp_path, after: str, **flags) -> tuple[int, str, float]:
    """Two nodes training a long run; node 1 (its trainer and torchrun) killed once node 0 printed
    `after`, like a node dying. Node 0's exit code, output, and the seconds it took to exit."""
    port = free_port()
    procs = [spawn_node(2, n, port, train_target(*tiny_flags(data, tok, tmp_path / f"n{n}", num_iterations=1000,
                                                             checkpoint_every=0, collective_timeout=60,
                                                             sync_warmup_ratio=0, **flags)))
             for n in range(2)]
    try:
        seen = read_until(procs[0], after, timeout=120)
        kill_tree(procs[1].pid, signal.SIGKILL)
        t0 = time.monotonic()
        out = seen + procs[0].communicate(timeout=90)[0]
        waited = time.monotonic() - t0
    finally:
        for p in procs:
            kill_tree(p.pid, signal.SIGKILL)
    return procs[0].returncode, out, waited


def test_a_node_lost_mid_inner_phase_is_noticed_at_the_next_step(tiny_data_dir, tiny_tokenizer_dir, tmp_path):
    """The nodes exchange no model traffic for 100 steps, but the stop flag's 4-byte all-reduce after
    every step is a heartbeat: node 0 notices node 1's death within a step, not at step 100."""
    code, out, waited = lose_node_one(tiny_data_dir, tiny_tokenizer_dir, tmp_path, "step 00003", sync_every=100)
    assert code != 0
    assert waited < 30, f"node 0 took {waited:.0f}s to notice (collective timeout 60 s)"
    assert "FATAL: collective 'all_reduce stop flag'" in out and "rank 1@" in out, out[-2000:]
    assert not re.search(r"outer step \d+ at step", out)  # it was noticed inside the inner phase


def test_a_node_lost_while_overlapped_syncs_cross_stops_the_other_within_seconds(tiny_data_dir, tiny_tokenizer_dir,
                                                                                  tmp_path):
    """With --outer-overlap on a sync is always crossing or about to: a node that dies then leaves
    the other's background thread, or its loop's next collective, failing at once (a reset
    connection), named, not hanging until the collective timeout."""
    code, out, waited = lose_node_one(tiny_data_dir, tiny_tokenizer_dir, tmp_path,
                                      "overlapped: it crosses in the background", sync_every=2, outer_overlap="on")
    assert code != 0
    assert waited < 30, f"node 0 took {waited:.0f}s to notice (collective timeout 60 s)"
    assert re.search(r"FATAL: collective '[^']+' at step \d+ failed", out), out[-2000:]


def test_compile_auto_decides_on_nodes_of_two_ranks_and_one(tiny_data_dir, tiny_tokenizer_dir, tmp_path):
    """--compile auto agrees on its timings among the ranks that step together. With local steps
    those are a node's ranks, and a one-rank node has no node group: its agreement must not fall
    through to every rank of the run, or nodes of two ranks and of one call different collectives."""
    flags = tiny_flags(tiny_data_dir, tiny_tokenizer_dir, tmp_path, sync_every=4, sync_warmup_ratio=0,
                       checkpoint_every=0, compile="auto", total_batch_size=384)
    port, env = free_port(), node_env()
    procs = [spawn_node(2, n, port, train_target(*flags), nproc=nproc, env=env) for n, nproc in enumerate((2, 1))]
    out = assert_ok(collect(procs, 120))
    assert re.search(r"rank 0/3\] compile off \(auto: eager [0-9.]+ s/step; the 8 steps left", out), out
    assert max(losses(out)) == 12, out
