"""`python -m nanochat_cpu.bench`: training throughput, MFU and where the time goes.

One measurement (`--nproc N` launches torchrun itself):
    python -m nanochat_cpu.bench --depth 4 --nproc 2 --compile off
The table in the README (depth 4 and 8, 1 and 2 processes, compile on and off):
    python -m nanochat_cpu.bench --table
The three shapes measured against upstream nanochat (docs/BENCHMARKS.md), eager and compiled:
    python -m nanochat_cpu.bench --shapes
Every result names the CPU it ran on (model name, AVX2/AVX-512/AMX): figures from one CPU say
little about another.

Each step is timed in four parts, each synchronised, so the sum is the step:
data (next batch), model (forward + backward), optimizer arithmetic, and communication
(time blocked in reduce-scatter/all-gather, reported by the optimizer). MFU is against a
matmul peak measured on this machine with the same thread count. Token ids are synthetic by
default (throughput does not depend on them) so any vocabulary size can be measured; pass
--data-dir/--tokenizer-dir to time the real parquet loader as well.

`--device cuda` measures a GPU node the same way (NCCL between processes, one GPU per process,
every part synchronised with the device; `--dtype bfloat16` is what the trainer's auto picks there).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

PROCESS_START = time.perf_counter()

import torch  # noqa: E402 - process start time is taken before the heavy import on purpose
import torch.distributed as dist  # noqa: E402

from .config import TrainConfig  # noqa: E402
from .dist import init_distributed  # noqa: E402
from .model import GPT, flops_per_token, model_config_from, parameter_breakdown  # noqa: E402
from .optim import build_optimizer  # noqa: E402
from .perf import cpu_has_native_bf16, cpu_model, measure_matmul_peak, peak_rss_mib, reuse_freed_memory, sync  # noqa: E402
from .precision import autocast_for, muon_dtype_for  # noqa: E402
from .shm import make_arena  # noqa: E402


class SyntheticBatches:
    def __init__(self, vocab: int, batch: int, seq: int, seed: int):
        self.gen = torch.Generator().manual_seed(seed)
        self.vocab, self.batch, self.seq = vocab, batch, seq

    def __iter__(self):
        return self

    def __next__(self):
        row = torch.randint(0, self.vocab, (self.batch, self.seq + 1), generator=self.gen)
        return row[:, :-1], row[:, 1:]


def worker(args: argparse.Namespace) -> None:
    allocator = reuse_freed_memory()  # as the trainer does
    env = init_distributed(args.device, timeout_s=600)  # the trainer's device and process group
    world, rank, device = env.world_size, env.rank, env.device
    tokens_per_rank = args.total_batch_size // world
    batch = tokens_per_rank // args.max_seq_len
    if args.tokenizer_dir:
        from .dataloader import TokenLoader
        from .tokenizer import Tokenizer

        tok = Tokenizer.load(args.tokenizer_dir)
        vocab = tok.vocab_size
        batches = TokenLoader(args.data_dir, tok, "train", batch, args.max_seq_len, rank, world)
    else:
        vocab = args.vocab_size
        batches = SyntheticBatches(vocab, batch, args.max_seq_len, seed=rank)
    cfg = TrainConfig(device=args.device, depth=args.depth, max_seq_len=args.max_seq_len,
                      head_dim=args.head_dim, window_pattern=args.window_pattern, muon_dtype=args.muon_dtype,
                      grad_comm_dtype=args.comm_dtype, param_comm_dtype=args.comm_dtype)
    model = GPT(model_config_from(args.depth, cfg.aspect_ratio, cfg.head_dim, vocab, args.max_seq_len,
                                  cfg.window_pattern))
    model.init_weights(0)
    model.to(device)
    muon_dtype, _ = muon_dtype_for(cfg.muon_dtype, cfg.device, cpu_has_native_bf16())
    arena, _ = make_arena(args.local_comm, rank, world, device, model)
    opt = build_optimizer(model, cfg, rank, world, muon_dtype, arena)
    fwd = torch.compile(model, dynamic=False) if args.compile == "on" else model
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    autocast = autocast_for(device, dtype)
    peak = measure_matmul_peak(device, dtype)
    fpt = flops_per_token(model)
    times: dict[str, list[float]] = {"data": [], "model": [], "optim": [], "comm": [], "step": []}
    first_step_s = None
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        x, y = next(batches)
        x, y = x.to(device), y.to(device)
        sync(device)
        t1 = time.perf_counter()
        with autocast:
            loss = fwd(x, y)
        opt.sync_in_backward = args.overlap == "on"
        (loss / world).backward()
        sync(device)
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        sync(device)
        t3 = time.perf_counter()
        if i == 0:
            first_step_s = t3 - PROCESS_START
        if i >= args.warmup:
            for k, v in (("data", t1 - t0), ("model", t2 - t1), ("optim", t3 - t2 - opt.last_comm_wait),
                         ("comm", opt.last_comm_wait), ("step", t3 - t0)):
                times[k].append(v)
    mean = {k: sum(v) / len(v) for k, v in times.items()}
    result = {"cpu": cpu_model(), "device": device.type, "dtype": args.dtype, "depth": args.depth,
              "head_dim": args.head_dim, "window_pattern": args.window_pattern, "nproc": world,
              "compile": args.compile, "comm_dtype": args.comm_dtype,
              "local_comm": args.local_comm, "malloc": allocator,
              "vocab": vocab, "tokens_per_step": args.total_batch_size, "threads": torch.get_num_threads(),
              "step_ms": round(mean["step"] * 1000, 1),
              "tok_per_s": round(args.total_batch_size / mean["step"], 1),
              "mfu_pct": round(100 * fpt * args.total_batch_size / mean["step"] / (peak * world), 1),
              "peak_gflops_per_rank": round(peak / 1e9, 1), "first_step_s": round(first_step_s or 0, 1),
              "params": parameter_breakdown(model)["total"], "flops_per_token": fpt,
              **{f"{k}_ms": round(v * 1000, 1) for k, v in mean.items() if k != "step"}}
    rss = [None] * world
    if world > 1:
        dist.all_gather_object(rss, peak_rss_mib())
        dist.destroy_process_group()
    else:
        rss = [peak_rss_mib()]
    result["peak_rss_mib_per_rank"] = round(max(rss), 0)
    if device.type == "cuda":  # this rank's; the others' GPUs hold the same model and batch size
        result["peak_gpu_mib_rank0"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 0)
    if rank == 0:
        print("BENCH " + json.dumps(result), flush=True)


def launch(args: argparse.Namespace, depth: int, nproc: int, compile_mode: str) -> dict:
    """Run one measurement in fresh processes (cold start included), return its result."""
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(max(1, args.cores // nproc))
    common = ["--depth", str(depth), "--head-dim", str(args.head_dim), "--window-pattern", args.window_pattern,
              "--compile", compile_mode, "--steps", str(args.steps),
              "--warmup", str(args.warmup), "--max-seq-len", str(args.max_seq_len),
              "--total-batch-size", str(args.total_batch_size), "--vocab-size", str(args.vocab_size),
              "--muon-dtype", args.muon_dtype, "--overlap", args.overlap, "--comm-dtype", args.comm_dtype,
              "--local-comm", args.local_comm, "--device", args.device, "--dtype", args.dtype]
    if args.tokenizer_dir:
        common += ["--data-dir", args.data_dir, "--tokenizer-dir", args.tokenizer_dir]
    if nproc == 1:
        cmd = [sys.executable, "-m", "nanochat_cpu.bench", "--worker", *common]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "nanochat_cpu.bench", "--worker", *common]
    # a fresh compile cache: first_step_s is a cold start, as on a node's first run
    with tempfile.TemporaryDirectory(prefix="nanochat-bench-inductor-") as cache:
        env["TORCHINDUCTOR_CACHE_DIR"] = cache
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("BENCH "):
            return json.loads(line[6:])
    raise RuntimeError(f"bench run failed ({' '.join(cmd)}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


# name: (depth, head_dim, window pattern, tokens a step), seq 512 and a 32,768 vocabulary; the last
# is upstream nanochat's own CPU recipe (runs/runcpu.sh: one micro-step of 32 rows)
SHAPES = {
    "d4-1k": (4, 128, "SSSL", 1024),
    "d8-1k": (8, 128, "SSSL", 1024),
    "d6-16k": (6, 64, "L", 16384),
}


def print_table(rows: list[dict]) -> None:
    cols = ["depth", "head_dim", "window_pattern", "tokens_per_step", "nproc", "compile", "tok_per_s", "mfu_pct",
            "step_ms", "model_ms", "optim_ms", "comm_ms", "data_ms", "first_step_s", "peak_rss_mib_per_rank"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="nanochat_cpu.bench", allow_abbrev=False)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--compile", choices=("on", "off"), default="off")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: one GPU per process, NCCL between them")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="autocast dtype of the model (the README's CPU table is float32)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--head-dim", type=int, default=128, help="the trainer's --head-dim (upstream's runcpu.sh: 64)")
    p.add_argument("--window-pattern", default="SSSL", help="the trainer's --window-pattern (runcpu.sh: L)")
    p.add_argument("--total-batch-size", type=int, default=1024)
    p.add_argument("--vocab-size", type=int, default=32768, help="nanochat's vocabulary, for comparison")
    p.add_argument("--muon-dtype", choices=("auto", "float32", "bfloat16"), default="auto")
    p.add_argument("--overlap", choices=("on", "off"), default="on",
                   help="start gradient reduce-scatters from backward hooks (the trainer always does)")
    p.add_argument("--local-comm", choices=("auto", "shm", "gloo"), default="auto",
                   help="ranks on one host share buffers in /dev/shm (the trainer's --local-comm)")
    p.add_argument("--comm-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="gradients and parameter updates on the wire (the trainer's --grad/--param-comm-dtype)")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--tokenizer-dir", default=None)
    p.add_argument("--cores", type=int, default=os.cpu_count() or 1, help="threads split over the processes")
    p.add_argument("--table", action="store_true", help="depth 4/8 x 1/2 processes x compile on/off")
    p.add_argument("--shapes", action="store_true", help=f"one process, compile off/on, at {', '.join(SHAPES)}")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error(f"--device cuda: torch {torch.__version__} sees no CUDA device (install the CUDA wheel, "
                f"or measure with --device cpu)")
    if args.worker:
        worker(args)
        return 0
    if args.shapes:
        rows = []
        for depth, head_dim, pattern, tokens in SHAPES.values():
            shape = argparse.Namespace(**{**vars(args), "head_dim": head_dim, "window_pattern": pattern,
                                          "total_batch_size": tokens})
            for compile_mode in ("off", "on"):
                rows.append(launch(shape, depth, 1, compile_mode))
                print(f"# {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
        print(f"CPU: {rows[0]['cpu']}")
        print_table(rows)
        return 0
    if not args.table:
        print(json.dumps(launch(args, args.depth, args.nproc, args.compile)))
        return 0
    rows = []
    # two processes need two GPUs on a CUDA node
    nprocs = (1, 2) if args.device == "cpu" else tuple(sorted({1, min(2, torch.cuda.device_count())}))
    for depth in (4, 8):
        for nproc in nprocs:
            for compile_mode in ("off", "on"):
                rows.append(launch(args, depth, nproc, compile_mode))
                print(f"# {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
    print(f"CPU: {rows[0]['cpu']}")
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
