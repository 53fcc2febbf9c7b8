#!/usr/bin/env python3
"""Does adding a node make training faster? Measure it on the local container cluster.

    sudo .venv/bin/python cluster/scaling_bench.py                   # the README's table
    sudo .venv/bin/python cluster/scaling_bench.py --depths 4 --links none,100mbit --nodes 3

Needs the local cluster up and provisioned (`make cluster-up`, then `ansible-playbook site.yml`)
and no training unit running. For each configuration it sets every node's CPU limit
(`podman update --cpus`) and link rate (cluster/shape.sh: tbf both ways), then runs the real
trainer on the chosen nodes exactly as the units do (nanochat_cpu.launch, static rendezvous on
the master's LAN address, GLOO_SOCKET_IFNAME = the node's interface), on the provisioned corpus
and tokenizer, and reads rank 0's step lines.

    solo tok/s   each node alone, at its CPU limit
    efficiency   cluster tok/s / sum of the participating nodes' solo tok/s
    vs fastest   cluster tok/s / the fastest participating node's solo tok/s (must be >= 1)
    vs fastest est   the same, as the trainer estimates it from its own timings (it logs a
                 "SLOWER THAN ONE NODE" line with the fix when it is below 1)

CPU shares: `even` gives every node --cpu-even CPUs; `half` gives node1 half of that (the laptop).
Split `off` = the same rows on every rank; `on` = --rank-batch-sizes auto (measured at start).
Comm `fp32` = gradients and parameters travel in fp32; `bf16` = --grad-comm-dtype and
--param-comm-dtype bfloat16 (half the bytes each way); `int8`, `int4` = bf16, and the outer
syncs of H > 1 quantized (--outer-compress). Solo runs always use fp32 (no wire).
Tokens per step are set per depth (--tokens-per-step 4:3072,8:12288): the wire bytes per step are
fixed by the model, so a larger step hides them behind more compute. `--batch-per cluster` (the
default) runs a cluster at those tokens across its nodes, as a solo steps on them alone; `node`
gives every node those tokens, so N nodes step on N times as many: DiLoCo's framing, where each
worker keeps the batch it trains with alone and the global batch grows with the workers (with
local steps each node runs its optimizer on the whole model every inner step, and this keeps that
cost the share of a step it is alone). Efficiency is ÷ Σ solos at --tokens-per-step either way.
Sync `--sync-every 1` = every step synchronous (ZeRO-2); H > 1 = DiLoCo, the nodes train alone and
meet every H steps; `auto` = the trainer picks H (column `h` = the H it used, from its
`sync-every auto: H=` line). Solo runs are always --sync-every 1. The local rows start local steps at
step 1 (--sync-warmup-ratio 0): a run's synchronous warm-up trains at the H = 1 row's speed.

The measured window. With H = 1: the steps after --warmup-steps, averaged. With H > 1 only the
boundary steps carry the outer sync (in their dt), so a mean over any steps would depend on how many
boundaries it caught: the window runs from just after one outer sync to an outer sync whole periods
later (from rank 0's `outer step K at step S` lines), and tok/s = its tokens / the sum of its dt. It
starts at the first outer sync at or after the warm-up, and for auto also at or after the step where
H was picked, so the first outer sync (for auto the one H is measured on) stays out. An integer H
runs H x max(1, ceil(warmup / H)) + 2H steps: exactly two whole periods measured. Where the syncs
overlap the inner steps (--outer-overlap), the run's last sync still blocks, once a run: a window
never ends at the last step then; and it starts at a sync that crosses in the background, so the
period after auto's timed first sync, which blocks, stays out as well: its steps ran with no sync
behind them (counted, it read 0.96 at depth 12 over 10 Mbit/s). auto runs --auto-steps steps (H
is not known before: the trainer caps it at 100) and measures every whole period after the pick
(column `periods`); it stops with the step count to use when not even one fits. `--auto-periods N`
cuts an auto run once N whole periods of its window are logged: a long --auto-steps then costs
nothing past them (at 10 Mbit/s a period is 30-40 minutes).

A cluster run is measured once rank 0 gives its verdict at the last step (`at the end:`): the
bench then SIGKILLs the trainers rather than wait for the run's final checkpoint (every rank's state
to every disk: minutes on a 10 Mbit/s link, and nothing it measures).

`--alongside` also measures, before each cluster size and CPU plan, those nodes training alone all
at the same time (a world of one each, its own batch; all stop when the first logs its last step).
On this host the nodes share two vCPUs and their caches, and the VM's speed drifts from one minute
to the next, so a node beside the others may compute at another speed than alone minutes earlier;
column `efficiency_alongside` = cluster tok/s / the sum of these solos, measured in the same
minutes on the same shared host, leaves that out: it is what the method itself loses (the wire, the
waiting, the outer syncs), the figure for nodes that are separate machines. `efficiency` stays ÷
the solos alone.
Results go to build/scaling.json as they come (rank 0's output of each run to build/scaling/), the table to
stdout at the end.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import re
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VENV = "/opt/nanochat/venv/bin/python"
STATE = "/var/lib/nanochat"
# rank 0's line, not rank_loss=
STEP = re.compile(r"step (\d+)/\d+ (?:\([0-9.]+%\) )?loss=.*?dt_ms=(\d+) tok_per_s=(\d+).*?"
                  r"compute_ms=(\d+) optim_ms=(\d+) comm_wait_ms=(\d+)")
OUTER = re.compile(r"outer step \d+ at step (\d+)\b(?:.*?sync_s=([0-9.]+))?")  # loose: the format may grow
AUTO = re.compile(r"sync-every auto: H=(\d+)")
OVERLAPPED = "overlapped: it crosses in the background"  # an outer step line of --outer-overlap


@dataclass
class Node:
    name: str
    container: str
    ipv4: str
    interface: str
    cpus: float | None  # the inventory's node_cpus, restored at the end
    bandwidth: str  # the inventory's node_bandwidth ("none" = unlimited), restored at the end


@dataclass
class Result:
    depth: int
    nodes: int
    link: str
    cpu: str
    split: str
    comm: str
    tokens_per_step: int
    tok_per_s: float
    step_ms: float
    compute_ms: float
    optim_ms: float
    comm_wait_ms: float
    rows: str
    efficiency: float | None = None
    vs_fastest: float | None = None
    vs_fastest_est: float | None = None  # the trainer's own estimate, from its timing line
    sync_every: str = "1"  # as asked (defaults: results written before DiLoCo still load)
    h: int = 1  # the H the trainer used
    outer_sync_ms: float | None = None  # mean sync_s of the window's outer syncs
    periods: int | None = None  # whole outer periods measured (H > 1)
    alongside: int | None = None  # a solo run while this many nodes (itself included) trained alone at once
    efficiency_alongside: float | None = None  # tok/s / the sum of the nodes' solos run alongside each other


def sh(cmd: list[str], timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise SystemExit(f"scaling_bench: {' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}"
                         f"\n{proc.stderr[-3000:]}")
    return proc


def read_inventory(inventory: Path) -> tuple[list[Node], str]:
    raw = json.loads(sh([str(REPO / ".venv/bin/ansible-inventory"), "-i", str(inventory), "--list"]).stdout)
    hostvars = raw["_meta"]["hostvars"]
    order = raw.get("master", {}).get("hosts", []) + raw.get("workers", {}).get("hosts", [])
    nodes = [Node(h, hostvars[h]["ansible_host"], hostvars[h]["node_ipv4"], hostvars[h]["train_interface"],
                  hostvars[h].get("node_cpus"), hostvars[h].get("node_bandwidth") or "none") for h in order]
    dataset = next((v.get("dataset_name") for v in hostvars.values() if v.get("dataset_name")), "fortunes")
    return nodes, dataset


def set_cpu(node: Node, cpus: float | None) -> None:
    sh(["podman", "update", f"--cpus={cpus or 0}", node.container])  # 0 = no limit


def set_link(node: Node, rate: str) -> None:
    """tbf at `rate` both ways, with shape.sh's default bucket (10 ms of traffic)."""
    sh([str(REPO / "cluster/shape.sh"), node.container, node.interface, rate])


def sync_every_value(text: str) -> str:
    if text != "auto" and not (text.isdigit() and int(text) >= 1):
        raise argparse.ArgumentTypeError(f"--sync-every values are 1, an integer H > 1 or auto, got {text!r}")
    return text if text == "auto" else str(int(text))  # "08" is 8: one spelling per H in the table


def steps_for(sync_every: str, args: argparse.Namespace) -> int:
    """Steps of a cluster run: see the module docstring's measured window."""
    if sync_every == "auto":
        return args.auto_steps
    h = int(sync_every)
    if h == 1:
        return args.steps
    return h * max(1, math.ceil(args.warmup_steps / h)) + 2 * h


def step_tokens(args: argparse.Namespace, depth: int, world: int) -> int:
    """--total-batch-size of a run on `world` nodes (one rank each): see --batch-per."""
    return args.tokens_per_step[depth] * (world if args.batch_per == "node" else 1)


def window_starts(out: str, sync_every: str, warmup: int) -> tuple[int | None, list[int]]:
    """(H as the trainer used it, the outer boundaries of rank 0's output `out` a window may start and
    end at); H is None while auto has not picked it. See the module docstring's measured window."""
    picked = AUTO.search(out) if sync_every == "auto" else None
    if sync_every == "auto" and not picked:
        return None, []
    h = int(picked.group(1)) if picked else int(sync_every)
    # the step in progress when auto picked H: the last step line before the pick
    since = max([int(m.group(1)) for m in STEP.finditer(out, 0, picked.start())], default=0) if picked else 0
    boundaries = [m for m in OUTER.finditer(out) if int(m.group(1)) >= max(warmup, since)]
    if OVERLAPPED in out:
        # a period is measured from a sync that crosses in its background: the period after a
        # blocking one (auto's timed first) runs without one, so its steps are not the run's
        boundaries = [m for m in boundaries if OVERLAPPED in out[m.start():out.find("\n", m.start())]]
    return h, [int(m.group(1)) for m in boundaries]


def measured_window(out: str, sync_every: str, warmup: int, num_steps: int) -> tuple[int, int, int]:
    """(first, last, H): measure the steps first+1 .. last of rank 0's output `out`; H as the trainer used it."""
    if sync_every == "1":
        return min(warmup, num_steps - 1), num_steps, 1
    h, starts = window_starts(out, sync_every, warmup)
    if h is None:
        raise SystemExit(f"scaling_bench: no 'sync-every auto: H=' line in rank 0's output:\n{out[-3000:]}")
    if not starts:
        raise SystemExit(f"scaling_bench: no outer sync after the {warmup} warm-up steps (and auto's pick) in "
                         f"rank 0's output (H={h}, {num_steps} steps; the line looks like 'outer step K at step S'):"
                         f"\n{out[-3000:]}")
    first = starts[0]
    # overlapped, the run's last sync blocks (as it must for the final weights): once a run, not a period's cost
    ends = [s for s in starts if (s - first) % h == 0 and not (s == num_steps and OVERLAPPED in out)]
    last = max(ends, default=first)
    if last == first:
        raise SystemExit(f"scaling_bench: H={h} leaves no whole outer period after step {first} of {num_steps}; "
                         f"run at least {first + 2 * h} steps (--auto-steps)")
    return first, last, h


def whole_periods_logged(out: str, warmup: int) -> int:
    """auto: the whole outer periods after the pick whose last step rank 0 has logged so far."""
    h, starts = window_starts(out, "auto", warmup)
    if h is None or not starts:
        return 0
    logged = {int(m.group(1)) for m in STEP.finditer(out)}
    ends = [s for s in starts if (s - starts[0]) % h == 0 and s in logged]
    return (max(ends) - starts[0]) // h if ends else 0


def window_means(out: str, sync_every: str, warmup: int, num_steps: int) -> dict[str, float | None]:
    """Rank 0's step times (ms) averaged over the measured window, its H and its outer syncs' mean ms."""
    first, last, h = measured_window(out, sync_every, warmup, num_steps)
    steps = {s[0]: s for s in (tuple(map(int, m.groups())) for m in STEP.finditer(out))}
    measured = [steps[s] for s in range(first + 1, last + 1) if s in steps]
    if len(measured) < last - first:
        raise SystemExit(f"scaling_bench: rank 0 logged {len(measured)} of the steps {first + 1}..{last}:\n"
                         f"{out[-3000:]}")
    # over whole outer periods the mean dt is the sum of dt / steps: each boundary counted once
    mean: dict[str, float | None] = {k: statistics.mean(s[i] for s in measured)
                                     for i, k in ((1, "dt"), (3, "compute"), (4, "optim"), (5, "comm"))}
    syncs = [float(m.group(2)) for m in OUTER.finditer(out) if m.group(2) and first < int(m.group(1)) <= last]
    mean["h"] = h
    mean["periods"] = (last - first) // h if sync_every != "1" else None
    mean["outer_sync_ms"] = round(1000 * statistics.mean(syncs)) if syncs else None
    return mean


def trainer_flags(args: argparse.Namespace, depth: int, world: int, split: str, comm: str, dataset: str,
                  num_steps: int, sync_every: str) -> list[str]:
    rows = args.rows_per_rank
    wire = "float32" if comm == "fp32" else "bfloat16"
    flags = ["--depth", str(depth), "--max-seq-len", str(args.seq), "--device-batch-size", str(rows),
             "--total-batch-size", str(step_tokens(args, depth, world)), "--num-iterations", str(num_steps),
             "--grad-comm-dtype", wire, "--param-comm-dtype", wire,
             "--dtype", "float32",  # the published table computes in fp32
             "--eval-every", "0", "--eval-tokens", str(args.seq * rows * world), "--sample-every", "0",
             "--checkpoint-every", "0", "--checksum-every", "0", "--tracking-uri", "none", "--compile", "off",
             "--resume", "never", "--collective-timeout", "900", "--run-name", "scaling", "--sync-every", sync_every,
             "--data-dir", f"{STATE}/data/{dataset}", "--tokenizer-dir", f"{STATE}/tokenizer/{dataset}",
             "--out-dir", "/tmp/nanochat-scaling"]
    if split == "on" and world > 1:
        flags += ["--rank-batch-sizes", "auto"]
    for name in ("outer_lr", "outer_momentum", "sync_warmup_ratio"):  # unset: the trainer's defaults
        if getattr(args, name) is not None:
            flags += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    if args.outer_overlap is not None and sync_every != "1":  # nothing to overlap: the trainer refuses it
        flags += ["--outer-overlap", args.outer_overlap]
    if comm.startswith("int") and sync_every != "1":  # nothing to compress: the trainer refuses it
        flags += ["--outer-compress", comm]
    return flags


def launch(nodes: list[Node], flags: list[str]) -> list[subprocess.Popen]:
    """One trainer world across `nodes` (one rank each), started as the units start it."""
    procs = []
    for rank, node in enumerate(nodes):
        env = {"GLOO_SOCKET_IFNAME": node.interface, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        cmd = ["podman", "exec", *[f"--env={k}={v}" for k, v in env.items()], node.container, "sh", "-c",
               "rm -rf /tmp/nanochat-scaling && exec " + " ".join(
                   [VENV, "-m", "nanochat_cpu.launch", f"--nnodes={len(nodes)}", "--nproc-per-node=1",
                    f"--node-rank={rank}", f"--master-addr={nodes[0].ipv4}", "--master-port=29500",
                    "--max-restarts=0", "-m", "nanochat_cpu.train", *flags])]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


def kill_trainers(nodes: list[Node]) -> Callable[[], None]:
    def kill() -> None:  # SIGKILL: a SIGTERMed trainer would write a checkpoint first
        for node in nodes:
            sh(["podman", "exec", node.container, "pkill", "-KILL", "-f", "nanochat_cpu"], check=False)
    return kill


def collect(procs: list[subprocess.Popen], timeout: float, measured: Callable[[list[str]], bool],
            kill: Callable[[], None]) -> tuple[list[str], bool, bool]:
    """(every process's output, cut, timed_out). Once `measured(the outputs so far)`, `kill()` (cut):
    what follows the measured steps is the run's final checkpoint, which on a 10 Mbit/s link takes
    minutes and tells the bench nothing. Past `timeout` seconds, `kill()` too (timed_out)."""
    chunks: list[list[str]] = [[] for _ in procs]
    readers = [threading.Thread(target=chunk.extend, args=(p.stdout,), daemon=True)
               for p, chunk in zip(procs, chunks, strict=True)]
    for r in readers:
        r.start()
    deadline, cut, timed_out = time.time() + timeout, False, False
    while any(p.poll() is None for p in procs):
        timed_out = time.time() > deadline
        cut = not timed_out and measured(["".join(c) for c in chunks])
        if timed_out or cut:
            kill()
            for p in procs:
                p.wait(timeout=60)
            break
        time.sleep(1)
    for r in readers:
        r.join(timeout=60)
    return ["".join(c) for c in chunks], cut, timed_out


def last_step_logged(out: str, num_steps: int) -> bool:
    return any(int(m.group(1)) == num_steps for m in STEP.finditer(out))


def result_of(out: str, args: argparse.Namespace, depth: int, world: int, split: str, comm: str, sync_every: str,
              num_steps: int) -> Result:
    mean = window_means(out, sync_every, args.warmup_steps, num_steps)
    tokens = step_tokens(args, depth, world)
    split_line = re.search(r"rows \[([0-9, ]+)\]", out)
    said = re.search(r"tok/s with \d+ ranks = ([0-9.]+)x what rank", out)
    return Result(depth=depth, nodes=world, link="", cpu="", split=split, comm=comm, tokens_per_step=tokens,
                  tok_per_s=round(tokens / (mean["dt"] / 1000), 1), step_ms=round(mean["dt"]),
                  compute_ms=round(mean["compute"]), optim_ms=round(mean["optim"]),
                  comm_wait_ms=round(mean["comm"]), rows=split_line.group(1).replace(" ", "") if split_line else "",
                  vs_fastest_est=float(said.group(1)) if said else None, sync_every=sync_every, h=mean["h"],
                  outer_sync_ms=mean["outer_sync_ms"], periods=mean["periods"])


def write_log(args: argparse.Namespace, name: str, text: str) -> Path:
    """A run's output beside the results (build/<out>/<name>.log)."""
    log = args.out.with_suffix("") / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(text)
    return log


def run_trainer(nodes: list[Node], args: argparse.Namespace, depth: int, split: str, comm: str, dataset: str,
                num_steps: int, sync_every: str = "1") -> Result:
    world = len(nodes)
    procs = launch(nodes, trainer_flags(args, depth, world, split, comm, dataset, num_steps, sync_every))
    def measured(outs: list[str]) -> bool:
        """Rank 0's verdict at the last step, before the final checkpoint; an auto run with
        --auto-periods once that many whole periods after its pick are logged."""
        if world == 1:
            return False
        return "at the end:" in outs[0] or (sync_every == "auto" and args.auto_periods > 0 and
                                            whole_periods_logged(outs[0], args.warmup_steps) >= args.auto_periods)

    outs, cut, timed_out = collect(procs, args.run_timeout, measured, kill_trainers(nodes))
    # rank 0's whole output beside the results: the numbers behind auto's H, the timing lines; kept
    # also when a run is cut short, whose measured steps may all be in it
    log = write_log(args, f"d{depth}-n{world}-{split}-{comm}-s{sync_every}-{time.strftime('%H%M%S')}", outs[0])
    if timed_out:
        raise SystemExit(f"scaling_bench: a run took over {args.run_timeout}s ({[n.name for n in nodes]}); "
                         f"rank 0's output: {log}")
    for p, out, node in zip(procs, outs, nodes, strict=True):
        if p.returncode != 0 and not cut:
            raise SystemExit(f"scaling_bench: the trainer failed on {node.name}:\n{out[-4000:]}")
    return result_of(outs[0], args, depth, world, split, comm, sync_every, num_steps)


def run_solos_alongside(nodes: list[Node], args: argparse.Namespace, depth: int, dataset: str,
                        num_steps: int) -> list[Result]:
    """Every node trains alone (a world of one, its own batch), all at the same time: what the nodes
    compute side by side on this host, where they share its cores and caches. All stop when the first
    logs its last step; each is measured over its steps after the warm-up up to then."""
    flags = trainer_flags(args, depth, 1, "off", "fp32", dataset, num_steps, "1")
    procs = [p for node in nodes for p in launch([node], flags)]

    def first_done(outs: list[str]) -> bool:
        return any(last_step_logged(out, num_steps) for out in outs)

    outs, _, timed_out = collect(procs, args.run_timeout, first_done, kill_trainers(nodes))
    stamp = time.strftime("%H%M%S")
    results = []
    for node, out in zip(nodes, outs, strict=True):
        log = write_log(args, f"d{depth}-solo-alongside{len(nodes)}-{node.name}-{stamp}", out)
        logged = max((int(m.group(1)) for m in STEP.finditer(out)), default=0)
        if logged <= args.warmup_steps:
            why = f"took over {args.run_timeout}s" if timed_out else f"logged {logged} steps when the first finished"
            raise SystemExit(f"scaling_bench: {node.name}'s solo beside {len(nodes) - 1} others {why}: none "
                             f"measured after the {args.warmup_steps} warm-up steps (raise --solo-steps); {log}")
        r = result_of(out, args, depth, 1, "off", "fp32", "1", logged)
        r.alongside = len(nodes)
        results.append(r)
    return results


def cpu_plan(nodes: list[Node], mode: str, even: float) -> dict[str, float]:
    plan = {n.name: even for n in nodes}
    if mode == "half" and len(nodes) > 1:
        plan[nodes[1].name] = even / 2
    return plan


def print_table(results: list[Result]) -> None:
    cols = ["depth", "tokens_per_step", "nodes", "alongside", "link", "cpu", "split", "comm", "sync_every", "h",
            "rows", "tok_per_s", "efficiency", "efficiency_alongside", "vs_fastest", "vs_fastest_est", "step_ms",
            "compute_ms", "optim_ms", "comm_wait_ms", "outer_sync_ms", "periods"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in results:
        d = asdict(r)
        print("| " + " | ".join("" if d[c] is None else str(d[c]) for c in cols) + " |", flush=True)


def per_depth(text: str) -> dict[int, int]:
    """'4:3072,8:12288' -> {4: 3072, 8: 12288}"""
    try:
        return {int(d): int(v) for d, v in (item.split(":") for item in text.split(","))}
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected depth:tokens pairs like 4:3072,8:12288, got {text!r}") from exc


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n", 2)[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--inventory", type=Path, default=REPO / "inventory/local")
    p.add_argument("--depths", default="4,8")
    p.add_argument("--nodes", default="2,3", help="cluster sizes to measure (solo runs are always measured)")
    p.add_argument("--links", default="none,1gbit,100mbit", help="tc rates; none = unlimited")
    p.add_argument("--cpus", default="even,half")
    p.add_argument("--splits", default="off,on", help="split by speed; 'on' is only run with uneven CPU")
    p.add_argument("--cpu-even", type=float, default=0.6, help="CPUs per node (the host has 2 for all of them)")
    p.add_argument("--seq", type=int, default=256, help="short sequences keep a step short on a 0.3-CPU node")
    p.add_argument("--rows-per-rank", type=int, default=2, help="--device-batch-size (the split moves rows)")
    p.add_argument("--comms", default="fp32",
                   help="on the wire: fp32, bf16 (gradients and updates), int8, int4 (bf16, outer "
                        "syncs quantized)")
    p.add_argument("--tokens-per-step", type=per_depth, default=per_depth("4:3072,8:12288"),
                   help="depth:tokens per optimizer step, each divisible by seq x rows x every world size")
    p.add_argument("--batch-per", choices=("cluster", "node"), default="cluster",
                   help="whom --tokens-per-step is for: the cluster's step, or each node's (N nodes step on N times "
                        "as many)")
    p.add_argument("--sync-every", type=lambda t: [sync_every_value(v) for v in t.split(",")], default=["1"],
                   help="comma list of --sync-every values for the cluster runs: 1, an integer H or auto")
    p.add_argument("--outer-lr", type=float, default=None, help="passed to the trainer (default: its own)")
    p.add_argument("--sync-warmup-ratio", type=float, default=0.0,
                   help="passed to the trainer (default 0: the local rows measure local steps; a run's synchronous "
                        "warm-up trains at the H = 1 row's speed)")
    p.add_argument("--outer-momentum", type=float, default=None, help="passed to the trainer (default: its own)")
    p.add_argument("--outer-overlap", choices=("auto", "on", "off"), default=None,
                   help="passed to the trainer's local-steps runs (default: its own)")
    p.add_argument("--steps", type=int, default=4, help="steps of a --sync-every 1 run")
    p.add_argument("--auto-steps", type=int, default=100, help="steps of a --sync-every auto run")
    p.add_argument("--auto-periods", type=int, default=0,
                   help="cut an auto run once it logged this many measured whole periods (after its pick; overlapped, "
                        "after its first sync in the background) (0: run --auto-steps)")
    p.add_argument("--solo-steps", type=int, default=None, help="steps of the solo runs (default --steps)")
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--solos-from", type=Path, action="append", default=[],
                   help="reuse the solo runs of an earlier --out file (same depth, tokens and CPU) instead of "
                        "measuring them again")
    p.add_argument("--alongside", action="store_true",
                   help="also measure each cluster's nodes training alone at the same time (column "
                        "efficiency_alongside = tok/s / the sum of those): what the method loses, apart from what "
                        "sharing this host and its drift do to the nodes' compute")
    p.add_argument("--run-timeout", type=float, default=1200,
                   help="seconds one trainer run may take (--sync-every 32 runs 96 steps: raise it at depth 8)")
    p.add_argument("--out", type=Path, default=REPO / "build/scaling.json")
    args = p.parse_args()
    nodes, dataset = read_inventory(args.inventory)
    depths = [int(d) for d in args.depths.split(",")]
    sizes = [int(n) for n in args.nodes.split(",") if 1 < int(n) <= len(nodes)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    results: list[Result] = []

    def record(r: Result) -> None:
        results.append(r)
        args.out.write_text(json.dumps([asdict(x) for x in results], indent=1))
        print("# " + json.dumps(asdict(r)), file=sys.stderr, flush=True)

    for n in nodes:
        set_link(n, "none")
    solo: dict[tuple[int, float], float] = {}  # (depth, cpus) -> tok/s; the nodes are identical but for CPU
    alongside: dict[tuple[int, int, str], list[float]] = {}  # (depth, size, cpu mode) -> each node's tok/s
    for earlier in args.solos_from:
        for r in json.loads(earlier.read_text()):
            if r["nodes"] == 1 and not r.get("alongside") and r["tokens_per_step"] == args.tokens_per_step.get(
                    r["depth"]):
                solo[(r["depth"], float(r["cpu"]))] = r["tok_per_s"]
                record(Result(**r))
    for depth in depths:
        for cpus in sorted({args.cpu_even, args.cpu_even / 2} if "half" in args.cpus else {args.cpu_even}):
            if (depth, cpus) in solo:
                continue
            set_cpu(nodes[0], cpus)
            r = run_trainer(nodes[:1], args, depth, "off", "fp32", dataset, args.solo_steps or args.steps)
            r.link, r.cpu = "-", f"{cpus:g}"
            solo[(depth, cpus)] = r.tok_per_s
            r.efficiency, r.vs_fastest = 1.0, 1.0
            record(r)
    for depth in depths:
        for link in args.links.split(","):
            for n in nodes:
                set_link(n, link)
            for size in sizes:
                members = nodes[:size]
                for mode in args.cpus.split(","):
                    plan = cpu_plan(members, mode, args.cpu_even)
                    for n in members:
                        set_cpu(n, plan[n.name])
                    if args.alongside and (depth, size, mode) not in alongside:
                        solos = run_solos_alongside(members, args, depth, dataset, args.solo_steps or args.steps)
                        for n, r in zip(members, solos, strict=True):
                            r.link, r.cpu = "-", f"{plan[n.name]:g}"
                            record(r)
                        alongside[(depth, size, mode)] = [r.tok_per_s for r in solos]
                    for split, comm, sync_every in itertools.product(args.splits.split(","), args.comms.split(","),
                                                                     args.sync_every):
                        if split == "on" and mode == "even":
                            continue  # the measured split of equal nodes is the even split
                        t0 = time.time()
                        r = run_trainer(members, args, depth, split, comm, dataset, steps_for(sync_every, args),
                                        sync_every)
                        r.link, r.cpu = link if link != "none" else "unlimited", mode
                        solos = [solo[(depth, plan[n.name])] for n in members]
                        r.efficiency = round(r.tok_per_s / sum(solos), 2)
                        r.vs_fastest = round(r.tok_per_s / max(solos), 2)
                        if (depth, size, mode) in alongside:
                            r.efficiency_alongside = round(r.tok_per_s / sum(alongside[(depth, size, mode)]), 2)
                        record(r)
                        print(f"# {time.time() - t0:.0f}s", file=sys.stderr, flush=True)
    for n in nodes:  # back to what the inventory says
        set_link(n, n.bandwidth)
        set_cpu(n, n.cpus)
    print_table(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
