"""Run configuration: one dataclass whose field names are the CLI flags.

`--max-seq-len` on the command line is `max_seq_len` here. The parser is generated from the
dataclass so the two can never drift apart. Validation that needs no process group (batch
arithmetic, ranges, paths) happens here, before rendezvous, so a bad value fails every rank
at once with a message instead of leaving some rank waiting in a collective. train.yml judges a
run's flags with the same parser and checks on the controller (run_args.py), so this module
imports no torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import re
import shutil
from dataclasses import dataclass, field
from typing import Any

# Fields that may legitimately differ between hosts of one run (paths, logging). Everything
# else must be identical on every rank and goes into the run fingerprint.
PER_HOST_FIELDS = frozenset(
    {"data_dir", "tokenizer_dir", "out_dir", "tracking_uri", "compile", "hybrid_threads", "collective_timeout",
     "peer_timeout"}
)

# --sync-warmup-ratio's default: at depth 4 and 2M tokens, H = 32 after 5% synchronous steps ended
# 0.11% below synchronous steps' val bpb (docs/TRAINER.md, "Local steps across nodes"); each
# synchronous step costs a slow link's whole-model traffic, so the warm-up is kept to what the
# quality needs
SYNC_WARMUP_RATIO = 0.05
OUTER_CODECS = ("none", "int8", "int4")  # --outer-compress (outer_codec.py)

RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # what --run-id may be: a marker's id, a file name


@dataclass
class TrainConfig:
    """The trainer's flags, each field one `--kebab-case` flag. A field whose metadata has
    "run_example" is one a train.yml run sets (run_args.py builds them in this order): its value is
    what the controller suggests when the extra-var of that name is wrong (None: no extra-var of
    that name sets it; train_device sets --device, and validate checks run_name itself)."""

    # where things are
    data_dir: str = field(default="data", metadata={"help": "parquet shards + manifest.json"})
    tokenizer_dir: str = field(default="tokenizer", metadata={"help": "dir holding tokenizer.json"})
    out_dir: str = field(default="runs", metadata={"help": "checkpoints and the local MLflow store"})
    run_name: str = field(default="base", metadata={"run_example": None,
                                                    "help": "names the checkpoint dir and the MLflow run"})
    run_id: str = field(default="", metadata={"help": "this run's identity, kept in every checkpoint: a resume takes "
                                                       "only the checkpoints of this id (train.yml passes the run's "
                                                       "own); empty = the one the checkpoints hold, or a new one"})
    tracking_uri: str = field(
        default="", metadata={"help": "MLflow tracking URI; empty = sqlite store under --out-dir; 'none' disables"}
    )
    # device truth: what the user asked for, never what hardware happens to exist
    device: str = field(default="cpu", metadata={"run_example": None,
                                                 "choices": ("cpu", "cuda"), "help": "device to train on"})
    dtype: str = field(
        default="auto",
        metadata={"run_example": "auto", "choices": ("auto", "float32", "bfloat16"),
                  "help": "auto: bf16 on CUDA; on CPU bf16 only where every rank's CPU has native bf16 "
                          "(AVX512-BF16/AMX), else fp32"},
    )
    compile: str = field(
        default="auto",
        metadata={"run_example": "auto",
                  "choices": ("auto", "on", "off"), "help": "torch.compile; auto = where measured faster"},
    )
    hybrid_threads: str = field(
        default="auto",
        metadata={"choices": ("auto", "off"),
                  "help": "on a CPU with P-cores and E-cores: auto = time a forward and backward pinned to the P-cores "
                          "and on every core, and keep the faster (core_types.py); off = as OMP_NUM_THREADS says"},
    )
    # model shape (nanochat's: width follows depth)
    depth: int = field(default=4, metadata={"run_example": "8", "help": "number of transformer blocks"})
    aspect_ratio: int = field(default=64, metadata={"help": "model_dim = depth * aspect_ratio (rounded to head_dim)"})
    head_dim: int = field(default=128, metadata={"help": "attention head dimension"})
    window_pattern: str = field(default="SSSL", metadata={"help": "per-layer windows: S = half context, L = full"})
    max_seq_len: int = field(default=512, metadata={"run_example": "512", "help": "context length in tokens"})
    # batch
    device_batch_size: int = field(default=2, metadata={"run_example": "2",
                                                        "help": "sequences per rank per micro-step"})
    rank_batch_sizes: str = field(
        default="",
        metadata={"help": "uneven split: sequences per micro-step for each rank, e.g. '6,2' (faster hosts "
                          "more); 'auto' measures each rank at start; empty = --device-batch-size everywhere"},
    )
    total_batch_size: int = field(default=1024, metadata={"run_example": "auto",
                                                          "help": "tokens per optimizer step over all ranks"})
    packing: str = field(
        default="bestfit",
        metadata={"run_example": "bestfit", "choices": ("bestfit", "stream"),
                  "help": "how documents fill the rows (train and val alike): bestfit = every row starts at a "
                          "document, the longest that fit whole first, the last one cropped to the row's end "
                          "(nanochat's loader: one giant document costs a row); stream = back to back, nothing "
                          "cropped (a document many rows long is read whole)"},
    )
    # schedule
    num_iterations: int = field(default=200, metadata={"run_example": "200", "help": "optimizer steps"})
    warmup_ratio: float = field(default=0.0, metadata={"help": "fraction of steps of linear LR warmup"})
    warmdown_ratio: float = field(default=0.2, metadata={"help": "fraction of steps of linear LR decay at the end"})
    final_lr_frac: float = field(default=0.0, metadata={"help": "LR at the end, as a fraction of the peak"})
    matrix_lr: float = field(default=0.02, metadata={"help": "Muon LR for the block matrices"})
    embedding_lr: float = field(default=0.2, metadata={"help": "AdamW LR for embeddings"})
    unembedding_lr: float = field(default=0.004, metadata={"help": "AdamW LR for the LM head"})
    scalar_lr: float = field(default=0.5, metadata={"help": "AdamW LR for the per-layer scalars"})
    weight_decay: float = field(default=0.0, metadata={"help": "decoupled weight decay on matrices"})
    muon_dtype: str = field(
        default="auto",
        metadata={"choices": ("auto", "float32", "bfloat16"), "help": "Newton-Schulz dtype; auto: bf16 where native"},
    )
    grad_comm_dtype: str = field(
        default="float32",
        metadata={"run_example": "bfloat16",
                  "choices": ("float32", "bfloat16"), "help": "dtype gradients travel in (bf16 halves the bytes)"},
    )
    param_comm_dtype: str = field(
        default="float32",
        metadata={"run_example": "bfloat16", "choices": ("float32", "bfloat16"),
                  "help": "dtype updated parameters travel in; bfloat16 sends rounded updates (half the bytes), "
                          "weights stay identical on every rank"},
    )
    local_comm: str = field(
        default="auto",
        metadata={"choices": ("auto", "shm", "gloo"),
                  "help": "ranks all on one host: share parameters, gradients and optimizer state in /dev/shm "
                          "instead of sending them through Gloo (auto: where possible)"},
    )
    # low-communication training across nodes (sync_diloco.py)
    sync_every: str = field(
        default="1",
        metadata={"run_example": "auto",
                  "help": "inner steps between the nodes' outer syncs: 1 = every step is synchronous (ZeRO-2); "
                          "H > 1 = each node trains alone for H steps, then the nodes average their progress "
                          "(DiLoCo); auto = the H at which waiting on the wire is at most 5 percent of the wall time, "
                          "from the first outer sync's measured seconds"},
    )
    # defaults: plain averaging, which beat DiLoCo's published 0.7 / 0.9 at H 8 and 32
    # (docs/TRAINER.md, "Local steps across nodes")
    outer_lr: float = field(default=1.0, metadata={"run_example": "1.0",
                                                   "help": "outer SGD LR on the nodes' averaged pseudo-gradient "
                                                           "(1 with momentum 0: the nodes' token-weighted average)"})
    outer_momentum: float = field(default=0.0, metadata={"run_example": "0.0",
                                                         "help": "outer Nesterov momentum, in [0, 1)"})
    outer_overlap: str = field(
        default="auto",
        metadata={"run_example": "off", "choices": ("auto", "on", "off"),
                  "help": "with local steps: on = each outer sync crosses in the background of the next inner "
                          "steps and lands a few steps late (none before an evaluation, a sample, a checkpoint or "
                          "the last step; --sync-every auto then needs only the steps a sync takes to cross); "
                          "auto = on where the first, timed, outer sync says a blocking one would hold the nodes "
                          "more than 5 percent of the time at the H they run and overlapped its own part is less, "
                          "off elsewhere and on CUDA; a resumed run keeps auto's choice"},
    )
    outer_compress: str = field(
        default="none",
        metadata={"run_example": "none", "choices": OUTER_CODECS,
                  "help": "with local steps: how the outer syncs' deltas and updates travel: none = in "
                          "--grad-comm-dtype and --param-comm-dtype; int8, int4 = quantized to that many "
                          "bits, one scale per block of values (256, 32), with error feedback (what rounding "
                          "dropped is sent with the next sync; the last of a run that reaches --num-iterations "
                          "exact): about 2 and 3.6 times fewer bytes than bf16. int8 cost no measured quality, "
                          "int4 some (docs/TRAINER.md)"},
    )
    # local steps cost the most quality early, while the model changes fastest (post-local SGD)
    sync_warmup_ratio: float = field(
        default=SYNC_WARMUP_RATIO,
        metadata={"run_example": "0.05",
                  "help": "with local steps (--sync-every above 1 or auto): the fraction of --num-iterations "
                          "trained with every step synchronous before the nodes start their inner phases "
                          "(with auto at least 3 steps: auto times 2, and at most the steps whose waits on the "
                          "wire fit in 5%% of the run's wall time; 0 = local steps from the first step)"},
    )
    # evaluation, logging, checkpoints
    eval_every: int = field(default=100, metadata={"run_example": "100",
                                                   "help": "steps between val bpb evaluations (0 = only at the end, "
                                                           "-1 = never)"})
    eval_tokens: int = field(default=16384, metadata={"run_example": "16384",
                                                      "help": "validation tokens per evaluation"})
    sample_every: int = field(default=100, metadata={"run_example": "100",
                                                     "help": "steps between samples from the model (0 = only at the "
                                                             "end, -1 = never)"})
    checkpoint_every: int = field(default=50, metadata={"run_example": "50",
                                                        "help": "steps between checkpoints (0 = only at end)"})
    keep_checkpoints: int = field(default=2, metadata={"help": "complete checkpoints to keep (at least 2: a "
                                                           "node that dies while one is sealed leaves the other)"})
    resume: str = field(
        default="auto", metadata={"run_example": "auto",
                                  "choices": ("auto", "never"), "help": "resume from the latest checkpoint"}
    )
    data_changed: bool = field(default=False, metadata={"help": "resume onto a dataset whose manifest differs from "
                                                                "the checkpoint's: the loader starts the new "
                                                                "data from its beginning"})
    checksum_every: int = field(default=50, metadata={"help": "steps between cross-rank parameter checksums"})
    collective_timeout: float = field(
        default=600.0, metadata={"help": "seconds a rank may wait in one collective before it exits"}
    )
    peer_timeout: float = field(
        default=30.0, metadata={"help": "an elastic launch: seconds without a peer's heartbeat before the "
                                        "others re-form the group without it (a laptop shut, off the WiFi)"}
    )
    seed: int = field(default=42, metadata={"run_example": "42", "help": "RNG seed (same on every rank)"})


class ConfigError(ValueError):
    """A configuration problem, reported before any rank joins a collective.

    Besides the message, its parts where there are any: the field, the value as given, the
    problem, and the valid values where they can be listed. train.yml's check on the controller
    (run_args.py) uses them to name the extra-var that set the flag.
    """

    def __init__(self, message: str, field: str = "", value: object = "", problem: str = "",
                 valid: list[Any] | tuple[Any, ...] = ()) -> None:
        super().__init__(message)
        self.field, self.value, self.problem, self.valid = field, str(value), problem, list(valid)


def flag_problem(name: str, value: object, problem: str) -> ConfigError:
    return ConfigError(f"--{name.replace('_', '-')}={value}: {problem}", name, value, problem)


def parser_for(spec: type, prog: str) -> argparse.ArgumentParser:
    """A parser whose flags are the dataclass `spec`'s fields (`max_seq_len` is `--max-seq-len`);
    a bool field is a switch that defaults to off."""
    # allow_abbrev=False: `--run` must never silently mean `--run-name` (docs/FAILURES.md row 10)
    parser = argparse.ArgumentParser(prog=prog, allow_abbrev=False)
    for f in dataclasses.fields(spec):
        flag = "--" + f.name.replace("_", "-")
        kwargs: dict[str, Any] = {"default": f.default, "help": f.metadata.get("help", "")}
        type_name = f.type if isinstance(f.type, str) else f.type.__name__
        if type_name == "bool":
            kwargs["action"] = "store_true"
        else:
            kwargs["type"] = {"int": int, "float": float, "str": str}[type_name]
        if "choices" in f.metadata:
            kwargs["choices"] = f.metadata["choices"]
        parser.add_argument(flag, dest=f.name, **kwargs)
    return parser


def build_parser() -> argparse.ArgumentParser:
    return parser_for(TrainConfig, "nanochat_cpu.train")


def parse_config(argv: list[str] | None = None) -> TrainConfig:
    args = build_parser().parse_args(argv)
    return TrainConfig(**vars(args))


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def nearest_valid_totals(unit: int, total: int) -> tuple[int, int]:
    below = max(unit, (total // unit) * unit)
    above = below if below >= total else below + unit
    return below, above


# Fields that must be positive integers: validate() checks them, and the controller's check says
# the same of a value that is not even an integer.
POSITIVE_FIELDS = ("depth", "aspect_ratio", "head_dim", "max_seq_len", "device_batch_size",
                   "total_batch_size", "num_iterations", "eval_tokens")


# Upper bounds, with the reason: far past any run a LAN cluster holds, low enough that a typo (a
# zero or three too many) fails here, on the controller, not by exhausting every node's memory at
# the first step. A model has about 12 x depth x model_dim^2 parameters.
MAX_STEPS = 10_000_000  # at one step a second, four months
MAX_LR = 10.0
UPPER_BOUNDS: dict[str, tuple[float, str]] = {
    "depth": (64, "64 blocks at the default aspect ratio are 13 B parameters; nanochat's largest has 32"),
    "aspect_ratio": (256, "model_dim = depth x aspect_ratio; nanochat uses 64"),
    "head_dim": (256, "no attention kernel is made for wider heads; nanochat uses 128"),
    "max_seq_len": (32768, "attention's cost grows with its square; nanochat pretrains at 2048"),
    "device_batch_size": (1024, "sequences per rank per micro-step: activations grow with them"),
    "total_batch_size": (1 << 24, "tokens per step; nanochat uses 524,288, this is 32 times that"),
    "num_iterations": (MAX_STEPS, "at one step a second, four months"),
    "eval_tokens": (100_000_000, "validation tokens read at every evaluation"),
    "eval_every": (MAX_STEPS, "--num-iterations' bound: a longer interval than any run is a typo"),
    "sample_every": (MAX_STEPS, "--num-iterations' bound: a longer interval than any run is a typo"),
    "checkpoint_every": (MAX_STEPS, "--num-iterations' bound: a longer interval than any run is a typo"),
    "checksum_every": (MAX_STEPS, "--num-iterations' bound: a longer interval than any run is a typo"),
    "keep_checkpoints": (100, "each is a full copy of the model and the optimizer state on disk"),
    "collective_timeout": (86400, "a day: how long a rank waits for a dead peer before it exits"),
    "peer_timeout": (86400, "a day: how long the others wait for a silent peer before they go on without it"),
    "matrix_lr": (MAX_LR, "the defaults are 0.004 to 0.5; beyond this training diverges at once"),
    "embedding_lr": (MAX_LR, "the defaults are 0.004 to 0.5; beyond this training diverges at once"),
    "unembedding_lr": (MAX_LR, "the defaults are 0.004 to 0.5; beyond this training diverges at once"),
    "scalar_lr": (MAX_LR, "the defaults are 0.004 to 0.5; beyond this training diverges at once"),
    "weight_decay": (MAX_LR, "each step shrinks the matrices by lr x weight_decay; nanochat uses 0 to 0.2"),
    "outer_lr": (MAX_LR, "DiLoCo uses 0.7, 1 is plain averaging"),
    "seed": (2**32 - 1, "numpy and most seeded tools take 32-bit seeds"),
}
MAX_SYNC_EVERY = (10_000, "DiLoCo's published H is 30 to 100 and auto stops at 100; more lets the nodes drift "
                          "apart for hours")
MIN_HEAD_DIM = 8
NEVER = -1  # --eval-every / --sample-every: not even at the end (nanochat's base_train convention)
MAX_MODEL_DIM = 8192  # 8192 wide at depth 64: 50 B parameters
MIN_MODEL_DIM = 32  # the value-embedding gate reads the first 32 channels (model.VE_GATE_CHANNELS)


def model_dim(depth: int, aspect_ratio: int, head_dim: int) -> int:
    """model.model_config_from's width: depth x aspect_ratio rounded up to whole heads (so the
    heads always divide it)."""
    return -(-depth * aspect_ratio // head_dim) * head_dim


def validate(cfg: TrainConfig, world_size: int, elastic: bool = False) -> None:
    """Raise ConfigError naming the value and the fix (the log line adds the host). `elastic`: the
    ranks are those of an elastic launch, which may be fewer or more than the run was planned for
    (`micro_step_rows`)."""
    for name in POSITIVE_FIELDS:
        value = getattr(cfg, name)
        if value <= 0:
            raise flag_problem(name, value, "must be a positive integer")
    if cfg.keep_checkpoints < 2:
        raise flag_problem("keep_checkpoints", cfg.keep_checkpoints, "must be at least 2 (while one is being "
                                                                      "sealed, the one before is the fallback)")
    for name in ("eval_every", "sample_every"):
        value = getattr(cfg, name)
        if value < NEVER:  # the fix in flags stays out of `problem`: train.yml words it in extra-vars
            flag = "--" + name.replace("_", "-")
            problem = "must be -1 (never), 0 (only at the end) or a number of steps"
            raise ConfigError(f"{flag}={value}: {problem}; fix: {flag} -1 to turn it off", name, value, problem)
    for name in ("checkpoint_every", "checksum_every"):  # a run is always checkpointed at its end
        if getattr(cfg, name) < 0:
            raise flag_problem(name, getattr(cfg, name), "must be >= 0")
    if cfg.run_id and not RUN_ID.fullmatch(cfg.run_id):
        raise flag_problem("run_id", cfg.run_id, "must be 1-64 letters, digits, '_', '.' or '-' (the id a "
                                                 "checkpoint's marker names)")
    for f in dataclasses.fields(cfg):  # nan/inf pass every comparison below: reject them first
        value = getattr(cfg, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise flag_problem(f.name, value, "must be a finite number")
    for name, (bound, why) in UPPER_BOUNDS.items():
        if getattr(cfg, name) > bound:
            raise too_large(name, getattr(cfg, name), bound, why)
    steps = sync_every_steps(cfg)
    if steps is not None and steps > MAX_SYNC_EVERY[0]:
        raise too_large("sync_every", cfg.sync_every, *MAX_SYNC_EVERY)
    validate_shape(cfg)
    for name in ("collective_timeout", "peer_timeout"):
        if getattr(cfg, name) <= 0:
            raise flag_problem(name, getattr(cfg, name), "must be > 0 seconds")
    for name in ("matrix_lr", "embedding_lr", "unembedding_lr", "scalar_lr", "weight_decay"):
        if getattr(cfg, name) < 0:
            raise flag_problem(name, getattr(cfg, name), "must be >= 0")
    if sync_every_steps(cfg) is None and cfg.sync_every != "auto":
        raise flag_problem("sync_every", cfg.sync_every, "must be a positive integer or auto")
    if cfg.outer_lr <= 0:
        raise flag_problem("outer_lr", cfg.outer_lr, "must be > 0 (1 with --outer-momentum 0 = plain averaging)")
    if not 0.0 <= cfg.outer_momentum < 1.0:
        raise flag_problem("outer_momentum", cfg.outer_momentum, "must be in [0, 1)")
    if cfg.outer_overlap == "on" and sync_every_steps(cfg) == 1:
        raise flag_problem("outer_overlap", cfg.outer_overlap, "overlaps the outer syncs of local steps: it needs "
                                                               "--sync-every above 1 or auto")
    if cfg.outer_overlap == "on" and cfg.device == "cuda":
        raise flag_problem("outer_overlap", cfg.outer_overlap, "is for CPU nodes: on CUDA the background sync would "
                                                               "share the training stream; --outer-overlap off")
    if cfg.outer_compress != "none" and sync_every_steps(cfg) == 1:
        raise flag_problem("outer_compress", cfg.outer_compress, "compresses the outer syncs of local steps: it "
                                                                 "needs --sync-every above 1 or auto")
    if not 0.0 <= cfg.sync_warmup_ratio < 1.0:
        raise flag_problem("sync_warmup_ratio", cfg.sync_warmup_ratio, "must be in [0, 1)")
    if cfg.seed < 0:
        raise flag_problem("seed", cfg.seed, "must be >= 0")
    for name in ("warmup_ratio", "warmdown_ratio", "final_lr_frac"):
        if not 0.0 <= getattr(cfg, name) <= 1.0:
            raise flag_problem(name, getattr(cfg, name), "must be in [0, 1]")
    if cfg.warmup_ratio + cfg.warmdown_ratio > 1.0:
        raise ConfigError(f"--warmup-ratio + --warmdown-ratio = {cfg.warmup_ratio + cfg.warmdown_ratio} > 1")
    if not cfg.window_pattern or set(cfg.window_pattern) - {"S", "L"}:
        raise flag_problem("window_pattern", repr(cfg.window_pattern), "use only the letters S and L, e.g. SSSL")
    sizes = explicit_rank_batch_sizes(cfg, world_size)
    if sizes is not None:
        unit = sum(sizes) * cfg.max_seq_len
        explain = f"sum(rank_batch_sizes) x max_seq_len = {sum(sizes)} x {cfg.max_seq_len} = {unit}"
    else:
        unit = cfg.device_batch_size * cfg.max_seq_len * world_size
        explain = (f"device_batch_size x max_seq_len x world_size = {cfg.device_batch_size} x {cfg.max_seq_len} x "
                   f"{world_size} = {unit}")
    regrouped = (elastic and sizes is None and cfg.total_batch_size % cfg.max_seq_len == 0
                 and micro_step_rows(cfg, cfg.total_batch_size // cfg.max_seq_len, world_size) is not None)
    if cfg.total_batch_size % unit and not regrouped:
        problem = f"is not divisible by {explain}"
        nearest = sorted(set(nearest_valid_totals(unit, cfg.total_batch_size)))
        raise ConfigError(
            f"--total-batch-size={cfg.total_batch_size} {problem}. {suggest(cfg, unit, sizes is None, world_size)}",
            "total_batch_size", cfg.total_batch_size, problem, nearest,
        )


def too_large(name: str, value: object, bound: float, why: str) -> ConfigError:
    flag = "--" + name.replace("_", "-")
    return flag_problem(name, value, f"must be at most {bound:,} ({why}); fix: {flag} {bound} or less")


def validate_shape(cfg: TrainConfig) -> None:
    """The model the flags make: heads that rotary embeddings can turn, a width the model can use."""
    if cfg.head_dim % 2 or cfg.head_dim < MIN_HEAD_DIM:
        raise flag_problem("head_dim", cfg.head_dim, f"must be an even number from {MIN_HEAD_DIM} to "
                                                     f"{UPPER_BOUNDS['head_dim'][0]} (rotary embeddings turn pairs of "
                                                     f"channels); fix: --head-dim 128 (nanochat's) or 64")
    dim = model_dim(cfg.depth, cfg.aspect_ratio, cfg.head_dim)
    shape = (f"model_dim = --depth {cfg.depth} x --aspect-ratio {cfg.aspect_ratio}, rounded up to whole heads of "
             f"--head-dim {cfg.head_dim}, = {dim}")
    if dim > MAX_MODEL_DIM:
        problem = (f"makes {shape}: more than {MAX_MODEL_DIM} (about {12 * cfg.depth * dim**2 / 1e9:.0f} B "
                   f"parameters); fix: --aspect-ratio {MAX_MODEL_DIM // cfg.depth} or less")
        raise flag_problem("aspect_ratio", cfg.aspect_ratio, problem)
    if dim < MIN_MODEL_DIM:
        raise flag_problem("aspect_ratio", cfg.aspect_ratio, f"makes {shape}: less than {MIN_MODEL_DIM}, the channels "
                                                             f"the value-embedding gate reads; fix: a larger "
                                                             f"--aspect-ratio or --head-dim")


def cxx_name() -> str:
    """The C++ compiler torch.compile's CPU backend runs (inductor: $CXX, else g++)."""
    return os.environ.get("CXX", "g++")


def cxx_compiler() -> str | None:
    """Its path, if this host has it."""
    return shutil.which(cxx_name())


def host_problems(cfg: TrainConfig, create: bool = True) -> list[str]:
    """This host's paths: the one part of the input that can differ between the ranks' hosts.

    Not raised before rendezvous like `validate`: a rank that left now would leave the others
    waiting for it in the rendezvous for the whole --collective-timeout. The ranks exchange
    these lists right after joining and all stop together, naming the host. `create=False`
    (the preflight) changes nothing: a missing --out-dir is judged by its nearest existing parent.
    """
    problems = []
    for name in ("data_dir", "tokenizer_dir"):
        path = getattr(cfg, name)
        if not os.path.isdir(path):
            problems.append(f"--{name.replace('_', '-')}={path}: no such directory (run site.yml to push it)")
    if cfg.compile == "on" and cfg.device == "cpu" and not cxx_compiler():
        problems.append(f"--compile on: no C++ compiler ({cxx_name()}) on this host, and "
                        f"torch.compile's CPU code is C++ it compiles: install g++, or use --compile auto "
                        f"(eager without one) or off")
    # checkpoints go here: find out now, not at the first checkpoint, that they cannot
    where = cfg.out_dir
    if create:
        try:
            os.makedirs(cfg.out_dir, exist_ok=True)
        except OSError as exc:
            return problems + [f"--out-dir={cfg.out_dir}: cannot create it ({exc.strerror}); point it at a "
                               f"writable directory"]
    else:
        where = nearest_existing_dir(cfg.out_dir)
    if not os.access(where, os.W_OK | os.X_OK):
        problems.append(f"--out-dir={cfg.out_dir}: {where} is not writable by uid {os.getuid()}; fix its owner "
                        f"(the unit runs as user nanochat) or point it elsewhere")
    return problems


def nearest_existing_dir(path: str) -> str:
    """`path` where it is a directory, else its nearest ancestor that is: what a directory not made
    yet will be on (its disk, its permissions)."""
    where = os.path.abspath(path)
    while not os.path.isdir(where) and os.path.dirname(where) != where:
        where = os.path.dirname(where)
    return where


def suggest(cfg: TrainConfig, unit: int, even: bool, world_size: int) -> str:
    below, above = nearest_valid_totals(unit, cfg.total_batch_size)
    totals = f"{below}" if below == above else f"{below} or {above}"
    text = f"Nearest valid --total-batch-size: {totals}"
    if even:
        rows = [d for d in range(cfg.device_batch_size, 0, -1)
                if cfg.total_batch_size % (d * cfg.max_seq_len * world_size) == 0]
        if rows:
            text += f"; or keep it and use --device-batch-size {rows[0]}"
    return text + "."


def explicit_rank_batch_sizes(cfg: TrainConfig, world_size: int) -> list[int] | None:
    """The per-rank split given on the command line; None when even or measured ('auto')."""
    if cfg.rank_batch_sizes in ("", "auto"):
        return None
    try:
        sizes = [int(x) for x in cfg.rank_batch_sizes.split(",")]
    except ValueError:
        raise ConfigError(f"--rank-batch-sizes={cfg.rank_batch_sizes!r}: expected integers like '6,2', "
                          f"'auto' or nothing") from None
    if len(sizes) != world_size or min(sizes) < 1:
        raise ConfigError(f"--rank-batch-sizes={cfg.rank_batch_sizes!r}: need {world_size} positive "
                          f"integers, one per rank (WORLD_SIZE={world_size})")
    bound, why = UPPER_BOUNDS["device_batch_size"]
    if max(sizes) > bound:
        raise ConfigError(f"--rank-batch-sizes={cfg.rank_batch_sizes!r}: {max(sizes)} sequences for one rank, more "
                          f"than {bound} ({why}); fix: at most {bound} per rank")
    return sizes


def micro_step_rows(cfg: TrainConfig, step_rows: int, world_size: int) -> int | None:
    """The rows of one micro-step over all ranks, for an even or measured split: device_batch_size x
    world_size, where that divides the step's rows (validate sees to it for the run as planned).
    An elastic run's world changes under it while its step stays the same tokens (its LR schedule
    and token count go on): there, the divisor of the step's rows nearest that, with one to twice
    device_batch_size rows a rank (the cap bounds a rank's activation memory), a multiple of the
    world for an even split; the larger of two as near. None where there is none."""
    planned = cfg.device_batch_size * world_size
    if step_rows % planned == 0:
        return planned
    even = cfg.rank_batch_sizes != "auto"
    options = [rows for rows in range(world_size, 2 * planned + 1)
               if step_rows % rows == 0 and not (even and rows % world_size)]
    return min(options, key=lambda rows: (abs(rows - planned), -rows)) if options else None


def sync_every_steps(cfg: TrainConfig) -> int | None:
    """--sync-every as a number of inner steps; None for auto (chosen at the first outer sync) or junk."""
    try:
        steps = int(cfg.sync_every)
    except ValueError:
        return None
    return steps if steps >= 1 else None


def sync_warmup_steps(cfg: TrainConfig) -> int:
    """The steps trained synchronously before local steps start (when --sync-every asks for them)."""
    return round(cfg.sync_warmup_ratio * cfg.num_iterations)


def grad_accum_steps(cfg: TrainConfig, sizes: list[int]) -> int:
    return cfg.total_batch_size // (sum(sizes) * cfg.max_seq_len)


def config_hash(cfg: TrainConfig) -> str:
    """Hash of the fields that must agree on every rank (paths and logging excluded)."""
    shared = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in PER_HOST_FIELDS}
    return hashlib.sha256(json.dumps(shared, sort_keys=True).encode()).hexdigest()
