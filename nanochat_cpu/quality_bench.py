"""`python -m nanochat_cpu.quality_bench`: what syncing less often costs in quality, at equal tokens.

    python -m nanochat_cpu.quality_bench                  # alone, 3 nodes in sync, 3 nodes at H = 8, 32, auto
    python -m nanochat_cpu.quality_bench --depth 2 --tokens 20000 --rows alone,sync   # does it run at all
    python -m nanochat_cpu.quality_bench --from build/quality.json                    # resume a long run
    python -m nanochat_cpu.quality_bench --rows sync,away                             # a node away a third

Rows: `alone` = one node; `sync` = --nodes nodes with --sync-every 1 (every step synchronous,
ZeRO-2); each H of --sync-every (default 8,32,auto) = the same nodes training alone for H steps
between outer syncs (DiLoCo; auto: the trainer picks H, column `H used`), after the trainer's
synchronous warm-up (--sync-warmup-ratio, its default unless given); `32:int8` = H 32 with the
outer syncs quantized (--outer-compress int8; int4 alike). `away` = the sync row's
nodes, launched as the units launch them (elastic: --nnodes=N-1:N, the c10d rendezvous hosted by
node 0, each node its own --out-dir), whose last node leaves (SIGTERM, as at a laptop's sleep)
when rank 0 reaches a third of the steps and comes back at two thirds: the others train on
without it, and it joins at a checkpoint. Its line under the table says how long it was away and
how many steps the others trained without it (a static launch trains none: the rest waits for it).
--rows picks some of them. A node is one launcher (nanochat_cpu.launch --nnodes N --node-rank r
--nproc-per-node 1) on loopback; the nodes share this host's cores, OMP_NUM_THREADS = max(1, cores // N) each, all
of them for `alone`.

Every row trains the same model (--depth, --seq) from the same seed on the same data and
tokenizer, the same steps of the same --total-batch-size tokens (steps = ceil(--tokens / total)),
in fp32 without compile, and is scored once, after its last step. --eval-tokens defaults to more
than the fortunes val split holds: each rank then reads its share of the split to the end, so
every row scores the same tokens, up to each rank's last partial batch.

    val_bpb    rank 0's final `eval step N val_bpb=X` line
    vs sync    (val_bpb - the sync row's) / the sync row's, in percent: what the row costs
    wall_s     launch to exit of the slowest node (start-up, training, eval, the final checkpoint)
    tok_per_s  tokens / the sum of rank 0's step times (training only)

The nodes share one host, so wall time and tok/s say nothing about a LAN (cluster/scaling_bench.py
measures speed on shaped links); this measures quality. Data: --data-dir and --tokenizer-dir, or
by default the offline fortunes corpus with the cluster's 4096-token vocabulary, prepared once
under build/quality-data/. Each row trains in build/quality/<row>/ (node<r>.log: each node's
output). Results go to build/quality.json after every row (the rows of this run only); --from
reuses the rows of an earlier file that ran with the same settings, so the same command with
--from build/quality.json goes on where a stopped benchmark stopped (and, with no file yet,
starts it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from . import dataset_build, tokenizer
from .config import OUTER_CODECS, nearest_valid_totals

REPO = Path(__file__).resolve().parent.parent
VOCAB = 4096  # the cluster's (roles/dataset), so the bpb compare with its runs
EVAL = re.compile(r"\] eval step (\d+) val_bpb=([0-9.]+)")
RANK0_STEP = re.compile(r"\[\S+ rank 0/(\d+)\] step (\d+)/")  # rank 0's world size and step
STEP_DT = re.compile(r"\] step \d+/\d+ (?:\([0-9.]+%\) )?loss=.*?dt_ms=(\d+)")  # rank 0's step line, not rank_loss=
AUTO = re.compile(r"sync-every auto: H=(\d+)")
OUTER = re.compile(r"outer step \d+ at step \d+")


@dataclass
class Row:
    row: str  # alone, sync, or the --sync-every value
    nodes: int
    sync_every: str
    settings: dict[str, Any]  # everything else a row's bpb depends on: --from reuses a row only if equal
    h: int | None = None  # the H the trainer used; None for alone and sync
    tokens: int = 0
    val_bpb: float | None = None
    wall_s: float | None = None
    tok_per_s: float | None = None
    threads: int = 0
    outer_syncs: int = 0  # rank 0's `outer step` lines
    log: str = ""
    away: dict[str, Any] | None = None  # the away row: when its node left and came back, what went on meanwhile


def is_h(name: str) -> bool:
    """An H row: auto or an integer H > 1, with its outer syncs' codec after a colon where they are
    compressed (32:int8: --sync-every 32 --outer-compress int8)."""
    h, _, codec = name.partition(":")
    return (h == "auto" or (h.isdigit() and int(h) > 1)) and (codec in OUTER_CODECS[1:] or not _)


def canonical(name: str) -> str:
    """One row name per H and codec: "08" is 8."""
    h, colon, codec = name.partition(":")
    return (h if not h.isdigit() else str(int(h))) + colon + codec


def h_values(text: str) -> list[str]:
    values = [t.strip() for t in text.split(",") if t.strip()]
    for value in values:
        if not is_h(value):
            raise argparse.ArgumentTypeError(f"--sync-every values are integers H > 1 or auto (H = 1 is the sync "
                                             f"row), each with :int8 or :int4 to compress its outer syncs; "
                                             f"got {value!r}")
    return [canonical(v) for v in values]


def row_names(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    for name in names:
        if name not in ("alone", "sync", "away") and not is_h(name):
            raise argparse.ArgumentTypeError(f"rows are alone, sync, away, auto or an integer H > 1 (each H with "
                                             f":int8 or :int4 to compress its outer syncs); got {name!r}")
    return [canonical(n) for n in names]


def plan(name: str, nodes: int) -> tuple[int, str]:
    """(nodes, --sync-every) of a row."""
    if name == "alone":
        return 1, "1"
    return nodes, "1" if name in ("sync", "away") else name.partition(":")[0]


def row_codec(name: str) -> str | None:
    """The row's --outer-compress (None: --outer-compress as given to the benchmark, or the trainer's)."""
    return name.partition(":")[2] or None


def batch_problem(rows: list[str], nodes: int, device_batch: int, seq: int, total: int) -> str:
    """Why --total-batch-size does not split evenly over every row's ranks; empty when it does."""
    multi = any(r != "alone" for r in rows)
    unit = device_batch * seq * (nodes if multi else 1)
    if total % unit == 0:
        return ""
    below, above = nearest_valid_totals(unit, total)
    which = (f"--device-batch-size x --seq x --nodes = {device_batch} x {seq} x {nodes} = {unit} (the {nodes}-node "
             f"rows; the alone row needs only {device_batch} x {seq})" if multi else
             f"--device-batch-size x --seq = {device_batch} x {seq} = {unit} (the alone row)")
    nearest = f"{below}" if below == above else f"{below} or {above}"
    return f"--total-batch-size={total} is not divisible by {which}. Nearest valid: {nearest}."


PASSED_ON = ("outer_lr", "outer_momentum", "outer_overlap", "outer_compress", "sync_warmup_ratio",
             "grad_comm_dtype", "param_comm_dtype", "packing")  # when given


def settings_of(args: argparse.Namespace, steps: int) -> dict[str, Any]:
    keys = ("depth", "seq", "device_batch_size", "total_batch_size", "eval_tokens", "seed", *PASSED_ON,
            "data_dir", "tokenizer_dir")
    return {"steps": steps, **{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k in keys}}


def trainer_flags(args: argparse.Namespace, steps: int, sync_every: str, out_dir: Path,
                  resume: str = "never", compress: str | None = None) -> list[str]:
    flags = ["--depth", str(args.depth), "--max-seq-len", str(args.seq), "--device-batch-size",
             str(args.device_batch_size), "--total-batch-size", str(args.total_batch_size),
             "--num-iterations", str(steps), "--seed", str(args.seed), "--sync-every", sync_every,
             "--dtype", "float32", "--compile", "off", "--eval-every", "0", "--eval-tokens", str(args.eval_tokens),
             "--sample-every", "0", "--checkpoint-every", "0", "--checksum-every", "0", "--resume", resume,
             "--tracking-uri", "none", "--run-name", "quality", "--data-dir", str(args.data_dir),
             "--tokenizer-dir", str(args.tokenizer_dir), "--out-dir", str(out_dir)]
    for name in PASSED_ON:  # unset: the trainer's defaults
        if name in ("outer_overlap", "outer_compress") and sync_every == "1":  # no outer syncs: the trainer refuses
            continue
        if getattr(args, name) is not None:
            flags += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    if compress is not None:  # the row's own: after the benchmark's, so it wins
        flags += ["--outer-compress", compress]
    return flags


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher_env(threads: int) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1", "GLOO_SOCKET_IFNAME": "lo",
            "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}


def launch(nodes: int, threads: int, flags: list[str], out_dir: Path, timeout: float) -> tuple[list[int], float]:
    """Every node's launcher on loopback, each writing out_dir/node<r>.log; (exit codes, wall seconds).

    The first node to fail stops the others: they would wait for it for the whole collective timeout.
    """
    env = launcher_env(threads)
    port = free_port()
    procs = []
    t0 = time.monotonic()
    for rank in range(nodes):
        cmd = [sys.executable, "-m", "nanochat_cpu.launch", f"--nnodes={nodes}", "--nproc-per-node=1",
               f"--node-rank={rank}", "--master-addr=127.0.0.1", f"--master-port={port}", "--max-restarts=0",
               "-m", "nanochat_cpu.train", *flags]
        with open(out_dir / f"node{rank}.log", "w") as log:  # the child keeps its own copy of the file
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO))
    try:
        while any(p.poll() is None for p in procs):
            if any(p.returncode for p in procs) or time.monotonic() - t0 > timeout:
                break
            time.sleep(0.2)
    finally:
        stop(procs)
    return [p.returncode for p in procs], time.monotonic() - t0


def stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM the launchers still running (torchrun stops its workers), SIGKILL what is left a minute later."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


ELASTIC_CONF = "join_timeout=600,last_call_timeout=5,keep_alive_interval=2,keep_alive_max_attempt=3"


def launch_away(nodes: int, threads: int, flags_of, out_dir: Path, steps: int, timeout: float
                ) -> tuple[list[int], float, dict[str, Any]]:
    """The away row's nodes, launched elastic on loopback; the last one leaves at a third of the
    steps and comes back at two thirds. (exit codes, wall seconds, what happened while it was away)."""
    env = launcher_env(threads)
    port, last = free_port(), nodes - 1

    def start(node: int) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "nanochat_cpu.launch", f"--nnodes={nodes - 1}:{nodes}", "--nproc-per-node=1",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=away", "--local-addr=127.0.0.1",
               "--max-restarts=5", f"--rdzv-conf=is_host={'true' if node == 0 else 'false'},{ELASTIC_CONF}",
               "-m", "nanochat_cpu.train", *flags_of(node)]
        with open(out_dir / f"node{node}.log", "a") as log:
            return subprocess.Popen(cmd, env={**env, "NODE_RANK": str(node)}, stdout=log, stderr=subprocess.STDOUT,
                                    cwd=REPO)

    def rank0_step() -> int:
        found = RANK0_STEP.findall((out_dir / "node0.log").read_text(errors="replace"))
        return int(found[-1][1]) if found else 0

    t0 = time.monotonic()
    procs = [start(node) for node in range(nodes)]
    leave_at, back_at = steps // 3, 2 * steps // 3
    left = back = None
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() - t0 < timeout:
            if any(p.returncode for i, p in enumerate(procs) if not (i == last and left and back is None)):
                break
            step = rank0_step()
            if left is None and step >= leave_at:
                procs[last].terminate()  # torchrun's stop: its ranks, and the others', stop at a checkpoint
                procs[last].wait(timeout=300)
                left = time.monotonic()
            elif left is not None and back is None and step >= back_at:
                procs[last] = start(last)
                back = time.monotonic()
            time.sleep(0.5)
    finally:
        stop(procs)
    wall = time.monotonic() - t0
    worlds = RANK0_STEP.findall((out_dir / "node0.log").read_text(errors="replace"))
    meanwhile = sorted({int(step) for world, step in worlds if int(world) < nodes})
    return [p.returncode for p in procs], wall, {
        "left_at_step": leave_at, "back_at_step": back_at,
        "away_s": round(back - left, 1) if left and back else None,
        "away_share": round((back - left) / wall, 3) if left and back else None,
        "steps_while_away": len(meanwhile)}


def read_log(text: str, sync_every: str) -> dict[str, Any]:
    """From rank 0's output: the final val bpb, the summed step seconds, the outer syncs and the H used."""
    evals = EVAL.findall(text)
    picked = AUTO.search(text)
    if sync_every == "1":
        h = None
    elif sync_every == "auto":
        h = int(picked.group(1)) if picked else None
    else:
        h = int(sync_every)
    return {"val_bpb": float(evals[-1][1]) if evals else None,
            "train_s": sum(int(ms) for ms in STEP_DT.findall(text)) / 1000,
            "outer_syncs": len(OUTER.findall(text)), "h": h}


def run_row(name: str, args: argparse.Namespace, steps: int, settings: dict[str, Any]) -> Row:
    nodes, sync_every = plan(name, args.nodes)
    threads = args.cores if nodes == 1 else max(1, args.cores // nodes)
    out_dir = args.work_dir / name.replace(":", "-")
    shutil.rmtree(out_dir, ignore_errors=True)  # --resume never, but an old checkpoint dir would still mix in
    out_dir.mkdir(parents=True)
    print(f"# {name}: {nodes} node(s) x {threads} thread(s), --sync-every {sync_every}, {steps} steps; "
          f"tail -f {out_dir}/node0.log", file=sys.stderr, flush=True)
    away = None
    if name == "away":  # each node its own disk, and a checkpoint to take up again at each change
        def flags_of(node: int) -> list[str]:
            return trainer_flags(args, steps, sync_every, out_dir / f"node{node}", resume="auto")
        codes, wall, away = launch_away(nodes, threads, flags_of, out_dir, steps, args.row_timeout)
    else:
        codes, wall = launch(nodes, threads, trainer_flags(args, steps, sync_every, out_dir,
                                                           compress=row_codec(name)), out_dir, args.row_timeout)
    text = (out_dir / "node0.log").read_text(errors="replace")
    if wall > args.row_timeout:
        raise SystemExit(f"quality_bench: row {name} took over --row-timeout {args.row_timeout:.0f} s; logs in "
                         f"{out_dir}")
    if any(codes):
        raise SystemExit(f"quality_bench: row {name} failed (exit codes by node {codes}; logs in {out_dir}):\n"
                         f"{text[-3000:]}")
    found = read_log(text, sync_every)
    if found["val_bpb"] is None:
        raise SystemExit(f"quality_bench: row {name}: no 'eval step N val_bpb=X' line in {out_dir}/node0.log")
    if sync_every != "1" and not found["outer_syncs"]:
        raise SystemExit(f"quality_bench: row {name}: the trainer logged no 'outer step' line with --sync-every "
                         f"{sync_every}; does it implement DiLoCo (nanochat_cpu/sync_diloco.py)?")
    tokens = steps * args.total_batch_size
    return Row(row=name, nodes=nodes, sync_every=sync_every, settings=settings, h=found["h"], tokens=tokens,
               val_bpb=found["val_bpb"], wall_s=round(wall, 1),
               tok_per_s=round(tokens / found["train_s"]) if found["train_s"] else None, threads=threads,
               outer_syncs=found["outer_syncs"], log=str(out_dir / "node0.log"), away=away)


def reusable(earlier: list[dict[str, Any]], name: str, nodes: int, settings: dict[str, Any]) -> Row | None:
    for r in earlier:
        if r["row"] == name and r["nodes"] == plan(name, nodes)[0] and r["settings"] == settings:
            return Row(**r)
    return None


def table(rows: list[Row]) -> list[str]:
    sync = next((r.val_bpb for r in rows if r.row == "sync"), None)
    lines = ["| row | nodes | sync_every | H used | tokens | val_bpb | vs sync | wall_s | tok_per_s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        delta = f"{100 * (r.val_bpb - sync) / sync:+.2f}%" if sync and r.val_bpb is not None else ""
        cells = [r.row, r.nodes, r.sync_every, "" if r.h is None else r.h, f"{r.tokens:,}", f"{r.val_bpb:.4f}",
                 delta, r.wall_s, "" if r.tok_per_s is None else f"{r.tok_per_s:,}"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    for r in rows:
        if r.away:
            a = r.away
            lines.append(f"\n{r.row}: node {r.nodes - 1} left at step {a['left_at_step']} and came back at step "
                         f"{a['back_at_step']}, away {a['away_s']} s ({100 * (a['away_share'] or 0):.0f}% of the "
                         f"row's wall time); the others trained {a['steps_while_away']} steps without it, until it was "
                         f"back in the group (a static launch: none, waiting for it)")
    return lines


def prepare_data(args: argparse.Namespace) -> None:
    """The default data and tokenizer: the fortunes corpus and a 4096-token BPE, built once."""
    if (args.data_dir is None) != (args.tokenizer_dir is None):
        raise SystemExit("quality_bench: give both --data-dir and --tokenizer-dir, or neither (the default is "
                         "the fortunes corpus with its own tokenizer)")
    if args.data_dir is not None:
        return
    root = REPO / "build/quality-data"
    args.data_dir, args.tokenizer_dir = root / "data", root / "tokenizer"
    if not (args.data_dir / "manifest.json").exists():
        dataset_build.corpus(args.data_dir)
    if not (args.tokenizer_dir / "tokenizer.json").exists():
        tokenizer.train(args.data_dir, VOCAB, args.tokenizer_dir)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m nanochat_cpu.quality_bench", description=__doc__.split("\n")[0],
                                epilog=__doc__.split("\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=3, help="nodes of every row but alone")
    p.add_argument("--sync-every", type=h_values, default=h_values("8,32,auto"), help="the H of the DiLoCo rows")
    p.add_argument("--rows", type=row_names, default=None, help="rows to run (default: alone, sync, each H)")
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--seq", type=int, default=256, help="--max-seq-len (the cluster's)")
    p.add_argument("--device-batch-size", type=int, default=2)
    p.add_argument("--total-batch-size", type=int, default=3072, help="tokens per step, every row (the cluster's)")
    p.add_argument("--tokens", type=int, default=2_000_000, help="tokens every row trains on (rounded up to steps)")
    p.add_argument("--eval-tokens", type=int, default=1_000_000,
                   help="val tokens scored at the end (default: more than the fortunes val split: all of it)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--outer-lr", type=float, default=None, help="passed to the trainer (default: its own)")
    p.add_argument("--sync-warmup-ratio", type=float, default=None, help="passed to the trainer (default: its own)")
    p.add_argument("--outer-momentum", type=float, default=None, help="passed to the trainer (default: its own)")
    p.add_argument("--outer-compress", choices=OUTER_CODECS, default=None,
                   help="passed to the trainer for every H row (default: its own; a row's :codec wins)")
    p.add_argument("--outer-overlap", choices=("auto", "on", "off"), default=None,
                   help="passed to the trainer's DiLoCo rows (default: its own)")
    for name in ("--grad-comm-dtype", "--param-comm-dtype"):  # what the wire's rounding costs
        p.add_argument(name, choices=("float32", "bfloat16"), default=None,
                       help="passed to the trainer (default: its own)")
    p.add_argument("--packing", choices=("bestfit", "stream"), default=None,
                   help="passed to the trainer (default: its own)")
    p.add_argument("--data-dir", type=Path, default=None)
    p.add_argument("--tokenizer-dir", type=Path, default=None)
    p.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)), help="shared out over the nodes")
    p.add_argument("--row-timeout", type=float, default=6 * 3600, help="seconds one row may take")
    p.add_argument("--work-dir", type=Path, default=REPO / "build/quality", help="each row's --out-dir and logs")
    p.add_argument("--out", type=Path, default=REPO / "build/quality.json")
    p.add_argument("--from", dest="earlier", type=Path, default=None,
                   help="reuse this file's finished rows (if it exists)")
    args = p.parse_args(argv)
    if args.rows is None:
        args.rows = ["alone", "sync", *args.sync_every]
    problem = batch_problem(args.rows, args.nodes, args.device_batch_size, args.seq, args.total_batch_size)
    if problem:
        p.error(problem)
    steps = math.ceil(args.tokens / args.total_batch_size)
    short = [r for r in args.rows if r.partition(":")[0].isdigit() and steps < int(r.partition(":")[0])]
    if short:
        p.error(f"--tokens {args.tokens:,} is {steps} steps of {args.total_batch_size}: rows {short} would never "
                f"sync (H > steps); raise --tokens")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    prepare_data(args)
    steps = math.ceil(args.tokens / args.total_batch_size)
    settings = settings_of(args, steps)
    # a --from file not there yet is nothing to reuse: one command starts and resumes the benchmark
    earlier = json.loads(args.earlier.read_text()) if args.earlier and args.earlier.exists() else []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    done: list[Row] = []
    for name in args.rows:
        row = reusable(earlier, name, args.nodes, settings)
        if row:
            print(f"# {name}: reused from {args.earlier}", file=sys.stderr, flush=True)
        else:
            row = run_row(name, args, steps, settings)
            print(f"# {name}: val_bpb {row.val_bpb:.4f}, {row.wall_s:.0f} s", file=sys.stderr, flush=True)
        done.append(row)
        args.out.write_text(json.dumps([asdict(r) for r in done], indent=1))
    print("\n".join(table(done)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
