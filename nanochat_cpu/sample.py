"""Talk to a trained model: `python -m nanochat_cpu.sample --out-dir RUN_DIR --prompt TEXT`.

Reads the newest complete checkpoint under RUN_DIR (or `--step N`), rebuilds the model from the
shape its COMPLETE marker records, checks the tokenizer against the sha256 recorded there, and
streams the continuation to stdout as it is sampled (KV cache, model.GPT.stream). `--interactive`
answers one prompt per line of stdin until an empty line or EOF. Only `model.pt` and `COMPLETE`
of a step are read, so a step directory copied to another machine without its optimizer states
(`rank*.pt`) samples there too. The header and the speed go to stderr, the text alone to stdout.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TextIO

import torch

from .checkpoint_files import list_steps, load_model_state, read_marker, step_dir
from .config import parser_for
from .dist import EXIT_CONFIG
from .model import GPT, ModelConfig
from .tokenizer import TOKENIZER_FILE, Tokenizer

# the files of a checkpoint that sampling reads; the rank files hold the optimizer, not the model
SAMPLING_FILES = ["model.pt"]
REPLACEMENT = "\ufffd"  # what decoding makes of a UTF-8 character whose bytes have not all come yet
NEW_CHECKPOINT_FIX = ("resume the run with this version until its next checkpoint (train.yml with the same "
                      "run_name and a higher num_iterations): checkpoints now record it")


@dataclass
class SampleConfig:
    out_dir: str = field(default="", metadata={"help": "the run's --out-dir (on a node /var/lib/nanochat/runs/<run>), "
                                                       "or where its checkpoints were copied"})
    step: int = field(default=-1, metadata={"help": "checkpoint step to load; -1 = the newest complete one"})
    prompt: str = field(default="The", metadata={"help": "text to continue"})
    max_tokens: int = field(default=128, metadata={"help": "tokens to sample at most (a BOS, the end of a "
                                                           "document, ends the answer sooner)"})
    temperature: float = field(default=0.8, metadata={"help": "softmax temperature; 0 = greedy"})
    top_k: int = field(default=50, metadata={"help": "sample among the k likeliest tokens; 0 = all"})
    seed: int = field(default=0, metadata={"help": "seed of the sampling draws (every answer starts from it)"})
    interactive: bool = field(default=False, metadata={"help": "read one prompt per line from stdin and stream "
                                                               "each answer; an empty line or EOF ends"})
    tokenizer_dir: str = field(default="", metadata={"help": "dir holding tokenizer.json; empty = the dir the "
                                                             "checkpoint records (the run's --tokenizer-dir)"})
    device: str = field(default="cpu", metadata={"choices": ("cpu", "cuda"), "help": "device to sample on"})
    dtype: str = field(default="float32", metadata={"choices": ("float32", "bfloat16"),
                                                    "help": "weights' dtype while sampling"})
    threads: int = field(default=0, metadata={"help": "CPU threads; 0 = torch's default (every core): on a node "
                                                      "that is training, 1 or 2 leave the run its cores"})
    kv_cache: str = field(default="on", metadata={"choices": ("on", "off"),
                                                  "help": "off: re-read the whole context every token (the "
                                                          "reference the cache is tested against; same tokens)"})


class SampleError(Exception):
    """A problem for the user, naming the value and the fix; exit code 2."""


def parse_sample_config(argv: list[str] | None = None) -> SampleConfig:
    return SampleConfig(**vars(parser_for(SampleConfig, "nanochat_cpu.sample").parse_args(argv)))


def validate(cfg: SampleConfig) -> None:
    if not cfg.out_dir:
        raise SampleError("--out-dir is required: the run's directory (on a node /var/lib/nanochat/runs/<run>, "
                          "or where its checkpoints were copied)")
    if cfg.max_tokens < 1:
        raise SampleError(f"--max-tokens={cfg.max_tokens}: must be a positive integer")
    if cfg.temperature < 0:
        raise SampleError(f"--temperature={cfg.temperature}: must be >= 0 (0 = greedy)")
    if cfg.top_k < 0:
        raise SampleError(f"--top-k={cfg.top_k}: must be >= 0 (0 = all tokens)")
    if cfg.threads < 0:
        raise SampleError(f"--threads={cfg.threads}: must be >= 0 (0 = torch's default)")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise SampleError("--device=cuda: torch sees no CUDA device here; fix: --device cpu")


# ---- the checkpoint: which step, its shape, its tokenizer --------------------------------------

def choose_step(cfg: SampleConfig) -> tuple[int, dict]:
    """The step to load (--step, or the newest complete one) and its COMPLETE marker."""
    if not os.path.isdir(cfg.out_dir):
        raise SampleError(f"--out-dir={cfg.out_dir}: no such directory; fix: the run's directory (on a node "
                          f"/var/lib/nanochat/runs/<run>), or fetch its checkpoint first (docs/TRAINER.md)")
    steps = list_steps(cfg.out_dir)
    markers = {s: read_marker(cfg.out_dir, s, SAMPLING_FILES) for s in steps}
    complete = [s for s, marker in markers.items() if marker is not None]
    unsealed = f"; steps there without their COMPLETE marker or model.pt: {sorted(set(steps) - set(complete))}" \
        if len(complete) < len(steps) else ""
    if not complete:
        raise SampleError(f"--out-dir={cfg.out_dir} holds no complete checkpoint (none under "
                          f"{os.path.join(cfg.out_dir, 'checkpoints')}/step_NNNNNN/ with model.pt and COMPLETE"
                          f"{unsealed}); fix: point --out-dir at a run that has saved one (every "
                          f"--checkpoint-every steps and at its end), or fetch one (docs/TRAINER.md)")
    step = complete[-1] if cfg.step == -1 else cfg.step
    if step not in complete:
        raise SampleError(f"--step={cfg.step}: no complete checkpoint at step {cfg.step} in {cfg.out_dir}; the "
                          f"complete steps there: {', '.join(map(str, complete))}{unsealed}; fix: --step one of "
                          f"them, or leave --step out for the newest ({complete[-1]})")
    return step, markers[step]


def model_config(cfg: SampleConfig, step: int, marker: dict) -> ModelConfig:
    if "model" not in marker:
        raise SampleError(f"checkpoint {step_dir(cfg.out_dir, step)} was written by an older version, whose "
                          f"COMPLETE marker does not record the model's shape (depth, width, heads, seq_len, "
                          f"windows, vocab); fix: {NEW_CHECKPOINT_FIX}")
    return ModelConfig(**marker["model"])


def load_tokenizer(cfg: SampleConfig, step: int, marker: dict, mcfg: ModelConfig) -> Tokenizer:
    """The tokenizer the checkpoint was trained with: --tokenizer-dir, else the dir it records,
    refused unless its sha256 is the recorded one."""
    tokdir = cfg.tokenizer_dir or marker["tokenizer_dir"]
    flag = f"--tokenizer-dir={tokdir}" if cfg.tokenizer_dir else f"the run's --tokenizer-dir {tokdir} (recorded " \
                                                                   f"in the checkpoint)"
    fix = (f"fix: --tokenizer-dir pointing at the run's tokenizer (on a node /var/lib/nanochat/tokenizer/<dataset>, "
           f"on the controller build/tokenizer/<dataset>), sha256 {marker['tokenizer_sha256'][:16]}")
    try:
        tokenizer = Tokenizer.load(tokdir)
    except (OSError, ValueError) as exc:
        raise SampleError(f"{flag}: cannot load {TOKENIZER_FILE} ({exc}); {fix}") from None
    if tokenizer.content_hash() != marker["tokenizer_sha256"] or tokenizer.vocab_size != mcfg.vocab_size:
        raise SampleError(f"{flag}: its tokenizer (sha256 {tokenizer.content_hash()[:16]}, vocab "
                          f"{tokenizer.vocab_size}) is not the one checkpoint step {step} was trained with (sha256 "
                          f"{marker['tokenizer_sha256'][:16]}, vocab {mcfg.vocab_size}): its token ids would mean "
                          f"other strings; {fix}")
    return tokenizer


@dataclass
class Loaded:
    model: GPT
    tokenizer: Tokenizer
    step: int


def load(cfg: SampleConfig) -> Loaded:
    step, marker = choose_step(cfg)
    mcfg = model_config(cfg, step, marker)
    tokenizer = load_tokenizer(cfg, step, marker, mcfg)
    device = torch.device(cfg.device)
    model = GPT(mcfg)
    try:
        model.load_state_dict(load_model_state(cfg.out_dir, step, device))
    except (OSError, RuntimeError) as exc:  # a truncated or foreign model.pt: name it, not a traceback
        raise SampleError(f"checkpoint {step_dir(cfg.out_dir, step)}: model.pt cannot be loaded as the model its "
                          f"COMPLETE marker describes ({type(exc).__name__}: {str(exc).splitlines()[0]}); fix: "
                          f"copy the step directory again, or --step another one") from None
    model.to(device=device, dtype=getattr(torch, cfg.dtype)).eval()
    return Loaded(model, tokenizer, step)


# ---- text out, as it is sampled -----------------------------------------------------------------

class TextStream:
    """Token ids in, printable text out. A byte-level token may end inside a UTF-8 character: its
    text waits until the character's last byte has come, so nothing half-decoded is printed."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.pending: list[int] = []  # the ids since the text last ended on a whole character
        self.shown = 0  # characters of their text already printed

    def push(self, token: int) -> str:
        self.pending.append(token)
        text = self.tokenizer.decode(self.pending)
        whole = text.rstrip(REPLACEMENT)
        out = whole[self.shown:]
        self.shown = len(whole)
        if whole == text:
            self.pending, self.shown = [], 0
        return out

    def flush(self) -> str:
        """What is left: bytes that never became a character print as the replacement character."""
        out = self.tokenizer.decode(self.pending)[self.shown:]
        self.pending, self.shown = [], 0
        return out


def answer(cfg: SampleConfig, loaded: Loaded, prompt: str) -> Iterator[str]:
    """The continuation of `prompt`, piece by piece; it ends at max_tokens or a BOS (a document's end)."""
    tokenizer = loaded.tokenizer
    text = TextStream(tokenizer)
    ids = [tokenizer.bos_id] + tokenizer.encode(prompt)
    for token in loaded.model.stream(ids, cfg.max_tokens, cfg.temperature, cfg.top_k, cfg.seed,
                                     kv_cache=cfg.kv_cache == "on"):
        if token == tokenizer.bos_id:
            break
        yield text.push(token)
    yield text.flush()


def write_answer(cfg: SampleConfig, loaded: Loaded, prompt: str, out: TextIO) -> tuple[int, float]:
    """Stream the answer to `out`; returns (tokens sampled, seconds)."""
    t0, tokens = time.perf_counter(), 0
    for piece in answer(cfg, loaded, prompt):
        tokens += 1
        out.write(piece)
        out.flush()
    return tokens - 1, time.perf_counter() - t0  # the last piece is the flush, not a token


def header(cfg: SampleConfig, loaded: Loaded) -> str:
    mcfg, model = loaded.model.cfg, loaded.model
    params = sum(p.numel() for p in model.parameters())
    return (f"checkpoint step {loaded.step} ({step_dir(cfg.out_dir, loaded.step)}) | {params:,} parameters: depth "
            f"{mcfg.n_layer}, width {mcfg.n_embd}, heads {mcfg.n_head}, seq_len {mcfg.seq_len}, windows "
            f"{model.windows}, vocab {mcfg.vocab_size} | tokenizer sha256 {loaded.tokenizer.content_hash()[:16]} | "
            f"{cfg.device} {cfg.dtype}, threads {torch.get_num_threads()}, kv cache {cfg.kv_cache} | temperature "
            f"{cfg.temperature} top-k {cfg.top_k} seed {cfg.seed}")


def speed(tokens: int, seconds: float) -> str:
    return f"{tokens} tokens in {seconds:.2f}s: {tokens / max(seconds, 1e-9):.1f} tok/s"


def run(cfg: SampleConfig) -> int:
    validate(cfg)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    loaded = load(cfg)
    print(header(cfg, loaded), file=sys.stderr)
    if not cfg.interactive:
        sys.stdout.write(cfg.prompt)
        tokens, seconds = write_answer(cfg, loaded, cfg.prompt, sys.stdout)
        sys.stdout.write("\n")
        print(speed(tokens, seconds), file=sys.stderr)
        return 0
    total_tokens, total_s = 0, 0.0
    while True:
        if sys.stdin.isatty():
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        prompt = line.rstrip("\r\n")
        if not prompt:  # an empty line or EOF
            break
        tokens, seconds = write_answer(cfg, loaded, prompt, sys.stdout)
        sys.stdout.write("\n")
        sys.stdout.flush()
        total_tokens, total_s = total_tokens + tokens, total_s + seconds
    print(speed(total_tokens, total_s), file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    cfg = parse_sample_config(argv)
    try:
        return run(cfg)
    except SampleError as exc:
        print(f"nanochat_cpu.sample: {exc}", file=sys.stderr)
        return EXIT_CONFIG


if __name__ == "__main__":
    sys.exit(main())
