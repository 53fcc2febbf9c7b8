"""Upstream nanochat's own base_train at bench's shapes: the other half of the side-by-side figures.

    python -m nanochat_cpu.upstream_bench --upstream ~/nanochat --prepare --data-dir data
    python -m nanochat_cpu.upstream_bench --upstream ~/nanochat                 # the three shapes
    python -m nanochat_cpu.upstream_bench --upstream ~/nanochat --shape d6-16k
    python -m nanochat_cpu.bench --shapes                                        # ours, same shapes
    python -m nanochat_cpu.upstream_bench --upstream ~/nanochat --pairs 9        # both, interleaved

The upstream checkout (git clone https://github.com/karpathy/nanochat; docs/BENCHMARKS.md names
the commit measured) runs in its own venv (`--python`, default `<upstream>/.venv/bin/python`),
which should hold the same torch as ours. It trains on our corpus: `--prepare` copies a data
directory's shards (`python -m nanochat_cpu.data ...`) into `<base-dir>/base_data_climbmix` under
upstream's names, the val shard last because upstream takes the last file for val, and trains
upstream's own tokenizer on them (its scripts.tok_train, 32,768 tokens). Nothing of upstream is
imported here: base_train runs as a subprocess, as a CPU user runs it: fp32, its default
torch.compile of the model and of its optimizer steps, evaluation, sampling and checkpoints
pushed past the timed steps (the final checkpoint it always writes is deleted after).

tok_s is the tokens of the steps from FIRST_TIMED_STEP on (its compile happens in the steps
before) over the sum of their times as base_train prints them: tokens / mean step time, as bench
reports ours. peak_rss_mib is the process's peak resident set (ru_maxrss: KiB / 1024, read as
/usr/bin/time reads it, see MEASURE_RSS).
Each result names the CPU it ran on, as bench's do.

`--pairs N` runs ours beside upstream: N rounds, each round every shape, each shape upstream's
base_train and our bench (eager fp32, as the trainer runs on a CPU, timed over as many steps as
upstream's run times) back to back, which one goes first swapped from round to round. A shared
or virtual host's speed drifts by 10% and more within the hour, often between two runs, so one
pair can land either side of a target; the ratio to quote is the median over the rounds, with
its range; memory is compared by the medians and by ours at its highest against upstream at
its lowest.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from .bench import SHAPES
from .data import read_manifest, split_files
from .perf import cpu_model

SEQ_LEN = 512
VOCAB = 32768  # upstream's tokenizer, as bench's vocabulary
FIRST_TIMED_STEP = 3
# default steps: 20 at 1,024 tokens a step (a second or less each), 8 at 16,384 (30 s or more)
SHORT_STEP_TOKENS, SHORT_STEP_ITERATIONS, LONG_STEP_ITERATIONS = 4096, 20, 8
MODEL_TAG = "upstream_bench"  # base_train's final checkpoint goes to base_checkpoints/<tag>, deleted after
# base_train's peak RSS, as /usr/bin/time measures it: from a small process that forks it and
# reads its rusage. A process spawned straight from this one would be charged this one's peak
# too: Linux carries the memory's high-water mark across exec (a test's 800-MiB pytest showed it)
MEASURE_RSS = """import os, sys
pid = os.fork()
if pid == 0:
    os.execvp(sys.argv[2], sys.argv[2:])
_, status, usage = os.wait4(pid, 0)
with open(sys.argv[1], "w") as f:
    f.write(str(usage.ru_maxrss))
code = os.waitstatus_to_exitcode(status)
sys.exit(code if code >= 0 else 128 - code)
"""
# base_train's step line: "step 00003/00020 (15.00%) | loss: 9.1 | ... | dt: 1234.56ms | tok/sec: 1,234 | ..."
STEP = re.compile(r"^step (\d+)/\d+ .*?\| dt: ([\d.]+)ms \| tok/sec: ([\d,]+)")


def base_train_command(python: str, depth: int, head_dim: int, pattern: str, tokens: int,
                       iterations: int) -> list[str]:
    """Upstream's base_train at one shape: one micro-step of tokens / SEQ_LEN rows, nothing
    but training steps in the run."""
    return [python, "-m", "scripts.base_train", "--run=dummy", "--device-type=cpu", f"--depth={depth}",
            f"--head-dim={head_dim}", f"--window-pattern={pattern}", f"--max-seq-len={SEQ_LEN}",
            f"--device-batch-size={tokens // SEQ_LEN}", f"--total-batch-size={tokens}",
            f"--num-iterations={iterations}", "--eval-every=-1", "--core-metric-every=-1",
            "--sample-every=-1", "--save-every=-1", f"--model-tag={MODEL_TAG}"]


def parse_steps(lines: list[str]) -> list[tuple[int, float, int]]:
    """(step, seconds, tok/s) of every step line base_train printed."""
    steps = []
    for line in lines:
        m = STEP.match(line.strip())
        if m:
            steps.append((int(m.group(1)), float(m.group(2)) / 1000, int(m.group(3).replace(",", ""))))
    return steps


def summarize(steps: list[tuple[int, float, int]], tokens: int) -> dict:
    """tok_s over the timed steps: tokens / their mean time (a mean of per-step rates would weigh
    the fast steps more)."""
    timed = [s for s in steps if s[0] >= FIRST_TIMED_STEP]
    first = round(steps[0][1], 2) if steps else None
    if not timed:
        return {"tok_s": None, "steps_timed": 0, "first_step_s": first}
    return {"tok_s": round(tokens / statistics.mean(s[1] for s in timed), 1), "steps_timed": len(timed),
            "first_step_s": first}


def upstream_env(base_dir: Path, threads: int) -> dict[str, str]:
    return {**os.environ, "NANOCHAT_BASE_DIR": str(base_dir.resolve()), "NANOCHAT_DTYPE": "float32",
            "OMP_NUM_THREADS": str(threads), "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1"}


def copy_shards(data_dir: Path, base_dir: Path) -> list[Path]:
    """Our train shards, then our val shard, as upstream's shard_NNNNN.parquet (it takes the last
    for val); the directory's earlier shards are removed, so nothing else is trained on."""
    manifest = read_manifest(data_dir)
    out = base_dir / "base_data_climbmix"
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.parquet"):
        old.unlink()
    names = split_files(manifest, "train") + split_files(manifest, "val")
    copies = [out / f"shard_{i:05d}.parquet" for i in range(len(names))]
    for name, copy in zip(names, copies, strict=True):
        shutil.copyfile(data_dir / name, copy)
    return copies


def prepare(args: argparse.Namespace) -> None:
    if args.data_dir is None:
        raise SystemExit("--prepare needs --data-dir: the corpus to copy (python -m nanochat_cpu.data ...)")
    copies = copy_shards(args.data_dir, args.base_dir)
    print(f"{len(copies)} shards in {copies[0].parent} (the last is val); training upstream's tokenizer", flush=True)
    subprocess.run([args.python, "-m", "scripts.tok_train", f"--vocab-size={VOCAB}"], cwd=args.upstream,
                   env=upstream_env(args.base_dir, args.threads), check=True)


def iterations_for(tokens: int) -> int:
    return SHORT_STEP_ITERATIONS if tokens <= SHORT_STEP_TOKENS else LONG_STEP_ITERATIONS


def run_shape(args: argparse.Namespace, name: str) -> dict:
    depth, head_dim, pattern, tokens = SHAPES[name]
    iterations = args.num_iterations or iterations_for(tokens)
    cmd = base_train_command(args.python, depth, head_dim, pattern, tokens, iterations)
    with tempfile.TemporaryDirectory() as tmp:
        rss_file = Path(tmp) / "maxrss_kib"
        proc = subprocess.Popen([sys.executable, "-c", MEASURE_RSS, str(rss_file), *cmd], cwd=args.upstream,
                                env=upstream_env(args.base_dir, args.threads), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True)
        lines = []
        try:
            for line in proc.stdout:  # upstream's own log, as it comes
                lines.append(line)
                print(line, end="", file=sys.stderr, flush=True)
            rc = proc.wait()
        except BaseException:  # interrupted (Ctrl-C): base_train must not go on training unwatched
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        finally:
            proc.stdout.close()
        peak_kib = int(rss_file.read_text()) if rss_file.exists() else 0
    shutil.rmtree(args.base_dir / "base_checkpoints" / MODEL_TAG, ignore_errors=True)
    return {"cpu": cpu_model(), "shape": name, "depth": depth, "head_dim": head_dim, "window_pattern": pattern,
            "tokens_per_step": tokens, "iterations": iterations, **summarize(parse_steps(lines), tokens),
            "peak_rss_mib": round(peak_kib / 1024), "threads": args.threads, "rc": rc,
            "upstream_commit": git_head(args.upstream), "torch": torch_version(args.python),
            "command": " ".join(cmd[1:])}


def ours_command(name: str, steps: int, threads: int) -> list[str]:
    """Our bench at one of the shapes, eager fp32 (the trainer's choice on a CPU), `steps` timed."""
    depth, head_dim, pattern, tokens = SHAPES[name]
    return [sys.executable, "-m", "nanochat_cpu.bench", "--depth", str(depth), "--head-dim", str(head_dim),
            "--window-pattern", pattern, "--total-batch-size", str(tokens), "--compile", "off",
            "--dtype", "float32", "--steps", str(steps), "--warmup", "1", "--cores", str(threads)]


def run_ours(args: argparse.Namespace, name: str, steps: int) -> dict:
    cmd = ours_command(name, steps, args.threads)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        print(done.stderr[-4000:], file=sys.stderr, flush=True)
        return {"tok_per_s": None, "peak_rss_mib_per_rank": None, "rc": done.returncode}
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "rc": 0}


def run_pair(args: argparse.Namespace, name: str, upstream_first: bool) -> dict:
    """Upstream and ours at one shape, back to back."""
    iterations = args.num_iterations or iterations_for(SHAPES[name][3])
    if upstream_first:
        up = run_shape(args, name)
    ours = run_ours(args, name, iterations - FIRST_TIMED_STEP)
    if not upstream_first:
        up = run_shape(args, name)
    # each side's whole result too (ours' step split, first steps): what to look at when a pair stands out
    print("UPSTREAM " + json.dumps(up), flush=True)
    print("OURS " + json.dumps(ours), flush=True)
    ratio = round(ours["tok_per_s"] / up["tok_s"], 3) if ours["tok_per_s"] and up["tok_s"] else None
    return {"shape": name, "first": "upstream" if upstream_first else "ours", "upstream_tok_s": up["tok_s"],
            "ours_tok_s": ours["tok_per_s"], "ratio": ratio, "upstream_peak_rss_mib": up["peak_rss_mib"],
            "ours_peak_rss_mib": ours["peak_rss_mib_per_rank"], "rc": up["rc"] or ours["rc"]}


def summarize_pairs(pairs: list[dict]) -> dict:
    """One shape's pairs that both finished: the median ratio and its range, and the peak RSS of
    each side, the medians and ours' highest against upstream's lowest."""
    done = [p for p in pairs if p["ratio"] is not None]
    if not done:
        return {"shape": pairs[0]["shape"], "pairs": 0, "failed": len(pairs)}
    ratios = [p["ratio"] for p in done]
    return {"shape": done[0]["shape"], "pairs": len(done), "failed": len(pairs) - len(done),
            "ratio_median": round(statistics.median(ratios), 3), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "upstream_tok_s_median": round(statistics.median(p["upstream_tok_s"] for p in done), 1),
            "ours_tok_s_median": round(statistics.median(p["ours_tok_s"] for p in done), 1),
            "upstream_peak_rss_mib_median": statistics.median(p["upstream_peak_rss_mib"] for p in done),
            "ours_peak_rss_mib_median": statistics.median(p["ours_peak_rss_mib"] for p in done),
            "upstream_peak_rss_mib_min": min(p["upstream_peak_rss_mib"] for p in done),
            "ours_peak_rss_mib_max": max(p["ours_peak_rss_mib"] for p in done)}


def run_pairs(args: argparse.Namespace, names: list[str]) -> int:
    """`--pairs` rounds; each round visits every shape, so a shape's pairs spread over the whole run."""
    pairs: dict[str, list[dict]] = {name: [] for name in names}
    for r in range(args.pairs):
        for name in names:
            pair = run_pair(args, name, upstream_first=r % 2 == 0)
            pairs[name].append(pair)
            print("PAIR " + json.dumps({"round": r + 1, **pair}), flush=True)
    summaries = [summarize_pairs(p) for p in pairs.values()]
    print(f"CPU: {cpu_model()}; upstream {git_head(args.upstream)}, torch {torch_version(args.python)}")
    print("| shape | pairs | ours ÷ upstream, median (range) | tok/s upstream / ours, medians "
          "| peak RSS MiB, medians upstream / ours | upstream's lowest / ours' highest |")
    print("|---|---|---|---|---|---|")
    for s in summaries:
        if s["pairs"]:
            spread = f"{s['ratio_median']:.2f}× ({s['ratio_min']:.2f}-{s['ratio_max']:.2f})"
            print(f"| {s['shape']} | {s['pairs']} | {spread} | {s['upstream_tok_s_median']} / {s['ours_tok_s_median']} "
                  f"| {s['upstream_peak_rss_mib_median']} / {s['ours_peak_rss_mib_median']} "
                  f"| {s['upstream_peak_rss_mib_min']} / {s['ours_peak_rss_mib_max']} |")
    for s in summaries:
        print("PAIRS " + json.dumps(s), flush=True)
    return 1 if any(s["failed"] or not s["pairs"] for s in summaries) else 0


def git_head(repo: Path) -> str:
    done = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else "unknown (not a git checkout)"


def torch_version(python: str) -> str:
    done = subprocess.run([python, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else "unknown"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="nanochat_cpu.upstream_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--upstream", type=Path, required=True, help="upstream nanochat's checkout")
    p.add_argument("--python", help="its venv's python (default <upstream>/.venv/bin/python)")
    p.add_argument("--base-dir", type=Path, help="its NANOCHAT_BASE_DIR (default <upstream>/base)")
    p.add_argument("--prepare", action="store_true", help="copy --data-dir's shards in, train its tokenizer")
    p.add_argument("--data-dir", type=Path, help="our corpus, for --prepare")
    p.add_argument("--shape", choices=list(SHAPES), action="append", help="default: all three")
    p.add_argument("--num-iterations", type=int, help="default: 20 at 1,024 tokens a step, 8 at 16,384")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--pairs", type=int, default=0, metavar="N",
                   help="N rounds of upstream and ours back to back at each shape; the median ratio")
    args = p.parse_args(argv)
    if not (args.upstream / "scripts" / "base_train.py").is_file():
        p.error(f"--upstream {args.upstream}: no scripts/base_train.py there (git clone upstream nanochat)")
    args.python = args.python or str(args.upstream / ".venv" / "bin" / "python")
    args.base_dir = args.base_dir or args.upstream / "base"
    if args.prepare:
        prepare(args)
        return 0
    if args.pairs:
        return run_pairs(args, args.shape or list(SHAPES))
    rc = 0
    for name in args.shape or list(SHAPES):
        result = run_shape(args, name)
        print("UPSTREAM " + json.dumps(result), flush=True)
        rc = rc or (1 if result["rc"] else 0)  # a signal's negative code is no exit status
    return rc


if __name__ == "__main__":
    sys.exit(main())
