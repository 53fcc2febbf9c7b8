"""Checkpoints that survive crashes mid-write, need no shared filesystem, and resume at any layout.

Layout under `<out_dir>/checkpoints/step_000100/`, on every node's disk:
- `model.pt`                the model
- `rank{r}.pt`              every rank's optimizer state, loader position and RNG state, for each
                            rank r of the world that wrote it (all of them, on every disk)
- `COMPLETE`                written last, once every disk's write succeeded: the checkpoint is valid
                            only when this marker exists and lists the files present; it names the
                            world that wrote it (world size, every rank's host and launcher)

Every file is written to a temporary name and renamed, and the directories are fsynced, so an
interrupted write (disk full, SIGKILL, power loss) leaves either the old file or the new one,
never half of one. A step without its COMPLETE marker is ignored on resume and cleaned up later.
Old checkpoints are deleted only after a newer one is complete, and never one newer than it.

Because every disk holds every rank's state, any one node can resume the whole run: on start the
ranks take the newest step that some disk holds whole, a disk that lacks it (wiped, replaced, a
node just added) gets it from one that has it over the process group, and a world of another
size or shape merges the saved ranks' states and takes its own part (the optimizer re-sharded,
the loader's epoch dealt out anew). A checkpoint that does not fit the run is refused by every
rank, and `--resume never` refuses a directory that holds checkpoints: a run never starts
afresh silently over an old one.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .data import row_group_pairs
from .dataloader import carry_over_position
from .dist import EXIT_CONFIG, DistEnv, Watchdog, fail, log
from .optim import merge_optimizer_states
from .sync_diloco import merge_outer_states

if TYPE_CHECKING:
    from .config import TrainConfig
    from .dataloader import TokenLoader
    from .model import GPT
    from .optim import MuonAdamW

STEP_DIR = re.compile(r"^step_(\d{6,})$")


def checkpoint_root(out_dir: str) -> str:
    return os.path.join(out_dir, "checkpoints")


def step_dir(out_dir: str, step: int) -> str:
    return os.path.join(checkpoint_root(out_dir), f"step_{step:06d}")


class _WriteErrors:
    """A file whose write errors are kept: torch.save turns a failed write (ENOSPC, EIO) into
    'enforce fail ... unexpected pos', and the reason would be lost."""

    def __init__(self, f):
        self.f, self.error = f, None

    def write(self, data) -> int:
        try:
            return self.f.write(data)
        except OSError as exc:
            self.error = self.error or exc
            raise

    def flush(self) -> None:
        self.f.flush()

    def fileno(self) -> int:
        return self.f.fileno()


def atomic_torch_save(obj, path: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            out = _WriteErrors(f)
            try:
                torch.save(obj, out)
            except RuntimeError as exc:
                if out.error is not None:
                    raise out.error from exc
                raise
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        # disk full: give the space of the partial file back (a SIGKILL leaves it; prune removes it)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fsync_dir(path: str) -> None:
    """Make the renames inside `path` durable: a rename is in the directory, not the file."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_step_files(out_dir: str, step: int, model_state: dict, rank_states: list[dict]) -> None:
    """Phase 1, once per disk: the model and every rank's state, so this disk alone can resume the
    run at any layout. The caller learns whether every disk's write succeeded, then seals."""
    d = step_dir(out_dir, step)
    if os.path.isdir(d):  # an unsealed wreck of an earlier attempt at this step: nothing of it is kept
        shutil.rmtree(d)
    os.makedirs(d)
    atomic_torch_save(model_state, os.path.join(d, "model.pt"))
    for r, state in enumerate(rank_states):
        atomic_torch_save(state, os.path.join(d, f"rank{r}.pt"))


def mark_complete(out_dir: str, step: int, layout: dict, keep: int) -> None:
    """Phase 2, after every disk's write succeeded: seal the checkpoint, make it durable, prune."""
    d = step_dir(out_dir, step)
    files = ["model.pt"] + [f"rank{r}.pt" for r in range(layout["world_size"])]
    missing = [f for f in files if not os.path.exists(os.path.join(d, f))]
    if missing:
        raise RuntimeError(f"checkpoint {d} is missing {missing} after the barrier")
    atomic_write_text(os.path.join(d, "COMPLETE"), json.dumps({"step": step, "files": files, **layout}))
    fsync_dir(d)
    fsync_dir(checkpoint_root(out_dir))
    prune(out_dir, keep, sealed=step)


def read_marker(out_dir: str, step: int) -> dict | None:
    """The COMPLETE marker of a step whose files are all present, else None. A marker without
    `world_size` was sealed by an older version, which kept only its own node's ranks' files."""
    d = step_dir(out_dir, step)
    try:
        with open(os.path.join(d, "COMPLETE")) as f:
            marker = json.load(f)
        files = marker["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not all(os.path.exists(os.path.join(d, name)) for name in files):
        return None
    return marker


def list_steps(out_dir: str) -> list[int]:
    root = checkpoint_root(out_dir)
    if not os.path.isdir(root):
        return []
    return sorted(int(m.group(1)) for n in os.listdir(root) if (m := STEP_DIR.match(n)))


def complete_steps(out_dir: str) -> list[int]:
    return [s for s in list_steps(out_dir) if read_marker(out_dir, s) is not None]


def prune(out_dir: str, keep: int, sealed: int) -> None:
    """After sealing step `sealed`: keep it and the newest `keep` - 1 complete checkpoints before it;
    drop older ones and stale incomplete ones. Nothing newer than `sealed` is touched: it is not this
    run's to judge (and an incomplete one may be being written right now)."""
    steps = list_steps(out_dir)
    older = [s for s in steps if s < sealed and os.path.exists(os.path.join(step_dir(out_dir, s), "COMPLETE"))]
    keep_set = set(older[len(older) - (keep - 1):]) if keep > 1 else set()
    for s in steps:
        if s < sealed and s not in keep_set:
            shutil.rmtree(step_dir(out_dir, s), ignore_errors=True)


def load_model_state(out_dir: str, step: int, device: torch.device) -> dict:
    return torch.load(os.path.join(step_dir(out_dir, step), "model.pt"), map_location=device, weights_only=True)


def load_rank_state(out_dir: str, step: int, rank: int) -> dict:
    return torch.load(os.path.join(step_dir(out_dir, step), f"rank{rank}.pt"), map_location="cpu",
                      weights_only=True)


# ---- the ranks together: save, agree on a step, resume -------------------------------------------

@dataclass
class Disks:
    """Where the ranks' checkpoints live. Nodes share no filesystem, but launchers on one host
    (the tests, the quality benchmark) may share an --out-dir: one writer per (host, directory)."""

    key_of_rank: list[tuple[str, str]]  # (host, real path of --out-dir) of every rank
    node_of_rank: list[int]  # every rank's launcher (torchrun's GROUP_RANK)

    def writer(self, rank: int) -> bool:
        return self.key_of_rank.index(self.key_of_rank[rank]) == rank

    def layout(self, hosts: list[str]) -> dict:
        """What the COMPLETE marker says of the world that wrote it."""
        return {"world_size": len(hosts), "hosts": hosts, "node_of_rank": self.node_of_rank}


def find_disks(cfg: TrainConfig, env: DistEnv, watchdog: Watchdog) -> Disks:
    mine = ((env.host, os.path.realpath(cfg.out_dir)), int(os.environ.get("GROUP_RANK", "0")))
    everyone = [mine]
    if env.distributed:
        everyone = [None] * env.world_size
        with watchdog.phase("all_gather checkpoint disks", 0):
            dist.all_gather_object(everyone, mine)
    return Disks([tuple(key) for key, _ in everyone], [node for _, node in everyone])


def on_cpu(obj):
    """A state with its tensors on the CPU: what travels between ranks and lands on disk."""
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, dict):
        return {k: on_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [on_cpu(v) for v in obj]
    return obj


def save_checkpoint(cfg: TrainConfig, env: DistEnv, disks: Disks, model: GPT, opt: MuonAdamW,
                    loader: TokenLoader, step: int, watchdog: Watchdog, extra: dict) -> None:
    t0 = time.perf_counter()
    rank_state = on_cpu({"step": step, "optimizer": opt.state_dict(), "loader": loader.state_dict(),
                         "rng": torch.get_rng_state(), "extra": extra})
    rank_states = [rank_state]
    if env.distributed:
        # every disk gets every rank's state: a node that is wiped, added or alone can still resume
        rank_states = [None] * env.world_size
        with watchdog.phase("all_gather checkpoint states", step):
            dist.all_gather_object(rank_states, rank_state)
    error = None
    if disks.writer(env.rank):
        try:
            write_step_files(cfg.out_dir, step, model.state_dict(), rank_states)
        except (OSError, RuntimeError) as exc:  # torch.save reports a failed write as RuntimeError
            done = complete_steps(cfg.out_dir)
            error = (f"cannot write checkpoint step {step} under {cfg.out_dir}: {type(exc).__name__}: {exc}. "
                     f"Earlier checkpoints are untouched (newest complete: {done[-1] if done else 'none'}). Fix: "
                     f"free space on {env.host} or move --out-dir, then start the run again: it resumes from there")
    del rank_states
    errors = [error]
    if env.distributed:
        # instead of a plain barrier: every rank learns whether every write succeeded, so a full
        # disk on one node stops all ranks with its reason (exit 2, no restart loop) rather than
        # leaving the others to time out in the next collective and restart without it
        errors = [None] * env.world_size
        with watchdog.phase("all_gather checkpoint status", step):
            dist.all_gather_object(errors, error)
    failed = [f"rank {r}@{env.hosts[r]}: {e}" if env.distributed else e for r, e in enumerate(errors) if e]
    if failed:
        fail(env, EXIT_CONFIG, " | ".join(failed))
    if disks.writer(env.rank):
        mark_complete(cfg.out_dir, step, disks.layout(env.hosts or [env.host]), cfg.keep_checkpoints)
    log(env, f"checkpoint step {step} saved to {step_dir(cfg.out_dir, step)} "
             f"in {time.perf_counter() - t0:.2f}s")


START_AFRESH = "start afresh with another --run-name or --out-dir"


def tokenizer_refusal(cfg: TrainConfig, where: str, saved: dict, tokenizer_sha: str, vocab_size: int) -> str | None:
    """Why the checkpoint at `where` (its saved `extra`) must not be resumed with this tokenizer."""
    if saved.get("tokenizer_sha256", tokenizer_sha) == tokenizer_sha:
        return None
    return (f"checkpoint {where} was trained with another tokenizer (sha256 {saved['tokenizer_sha256'][:16]}, "
            f"vocab {saved.get('vocab_size', '?')}) than --tokenizer-dir={cfg.tokenizer_dir} "
            f"(sha256 {tokenizer_sha[:16]}, vocab {vocab_size}): its token ids mean other strings. Fix: push the "
            f"run's original tokenizer again (site.yml), or {START_AFRESH}")


def survey(cfg: TrainConfig, env: DistEnv, watchdog: Watchdog) -> list[dict[int, dict]]:
    """Every rank's complete checkpoints on its disk: {step: its COMPLETE marker}, by rank."""
    mine = {s: read_marker(cfg.out_dir, s) for s in complete_steps(cfg.out_dir)}
    if not env.distributed:
        return [mine]
    everyone: list = [None] * env.world_size
    with watchdog.phase("all_gather checkpoint steps", 0):
        dist.all_gather_object(everyone, mine)
    return everyone


def holdings(env: DistEnv, everyone: list[dict[int, dict]]) -> str:
    hosts = env.hosts or [env.host]
    return "; ".join(f"rank {r}@{hosts[r]}: steps {sorted(steps) or 'none'}" for r, steps in enumerate(everyone))


def choose_resume_step(cfg: TrainConfig, env: DistEnv, everyone: list[dict[int, dict]]) -> int | None:
    """The newest step some disk holds whole; None for a fresh run. A checkpoint sealed by an older
    version holds only its node's ranks' files: it counts only where every rank's disk has it."""
    if cfg.resume == "never":
        if any(everyone):
            fail(env, EXIT_CONFIG, f"--resume never, but {cfg.out_dir} already holds this run's checkpoints "
                                   f"({holdings(env, everyone)}): a fresh run would mix with them and prune them. "
                                   f"Fix: another --run-name or --out-dir for a new run, or --resume auto to go on "
                                   f"with this one")
        return None
    usable = set()
    for steps in everyone:
        usable |= {s for s, marker in steps.items() if "world_size" in marker}
    usable |= set.intersection(*(set(steps) for steps in everyone))
    return max(usable) if usable else None


def restore_missing(cfg: TrainConfig, env: DistEnv, disks: Disks, step: int, everyone: list[dict[int, dict]],
                    watchdog: Watchdog) -> None:
    """The disks that lack checkpoint `step` (wiped, replaced, or a node just added) get it from the
    lowest rank that has it, over the process group, before anyone loads it."""
    holders = [r for r, steps in enumerate(everyone) if step in steps]
    needy = [r for r in range(env.world_size) if disks.writer(r) and step not in everyone[r]]
    if not needy:
        return
    source, t0 = holders[0], time.perf_counter()
    with watchdog.phase("new_group checkpoint restore", 0):
        group = dist.new_group([source, *needy])  # every rank must call it, members or not
    if env.rank in (source, *needy):
        d = step_dir(cfg.out_dir, step)
        files = [None]
        if env.rank == source:
            marker = everyone[source][step]
            files = [{name: Path(d, name).read_bytes() for name in marker["files"]}]
        with watchdog.phase("broadcast checkpoint files", 0):
            dist.broadcast_object_list(files, src=source, group=group)
        if env.rank in needy:
            write_restored(cfg.out_dir, step, files[0], everyone[source][step], cfg.keep_checkpoints)
            size = sum(len(b) for b in files[0].values())
            log(env, f"checkpoint step {step} was missing on this disk: restored from rank {source}@"
                     f"{env.hosts[source]} ({size / 2**20:.0f} MiB in {time.perf_counter() - t0:.1f}s)")
        del files
    with watchdog.phase("barrier checkpoint restore", 0):
        dist.barrier()
    dist.destroy_process_group(group)


def write_restored(out_dir: str, step: int, files: dict[str, bytes], marker: dict, keep: int) -> None:
    d = step_dir(out_dir, step)
    if os.path.isdir(d):
        shutil.rmtree(d)
    os.makedirs(d)
    for name, data in files.items():
        tmp = os.path.join(d, f"{name}.tmp.{os.getpid()}")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(d, name))
    atomic_write_text(os.path.join(d, "COMPLETE"), json.dumps(marker))
    fsync_dir(d)
    fsync_dir(checkpoint_root(out_dir))
    prune(out_dir, keep, sealed=step)


def sync_refusal(where: str, saved: dict, local_steps: bool) -> str | None:
    """Why a checkpoint of the other kind of sync (its saved `extra`) must not be resumed: local
    steps keep a whole optimizer state per node, synchronous steps one shard per rank."""
    saved_local = "outer" in saved
    if saved_local == local_steps:
        return None
    kinds = {True: "local steps (--sync-every above 1 or auto)", False: "every step synchronous (--sync-every 1)"}
    return (f"checkpoint {where} was trained with {kinds[saved_local]}, this run asks for {kinds[local_steps]}: "
            f"their optimizer states are laid out differently (a whole one per node, or a shard per rank). Fix: "
            f"resume with the run's --sync-every, or {START_AFRESH}")


def ranks_by_node(node_of_rank: list[int]) -> list[list[int]]:
    """The ranks of each launcher, in launcher order (as sync_diloco.find_nodes groups them)."""
    by_node: dict[int, list[int]] = {}
    for rank, node in enumerate(node_of_rank):
        by_node.setdefault(node, []).append(rank)
    return [by_node[n] for n in sorted(by_node)]


def load_states(cfg: TrainConfig, env: DistEnv, disks: Disks, step: int, marker: dict,
                local_steps: bool) -> tuple[dict, dict | None, str]:
    """This rank's optimizer state, loader position, RNG and `extra` from checkpoint `step`, and how it
    was laid out. The same layout loads the rank's own file as it was saved (the resumed run repeats
    the uninterrupted one exactly); another one merges every saved rank's state and takes its part."""
    where = step_dir(cfg.out_dir, step)
    now = disks.layout(env.hosts or [env.host])
    wrote = f"written by {marker.get('world_size', 'this layout of')} ranks on hosts " \
            f"{', '.join(sorted(set(marker.get('hosts', now['hosts']))))}"
    if "world_size" not in marker or (marker["world_size"], marker["node_of_rank"]) == (now["world_size"],
                                                                                     now["node_of_rank"]):
        state = load_rank_state(cfg.out_dir, step, env.rank)
        return state, state["loader"], f"resumed from checkpoint step {step} ({where}), {wrote}"
    saved = [load_rank_state(cfg.out_dir, step, r) for r in range(marker["world_size"])]
    state = dict(saved[min(env.rank, len(saved) - 1)])
    state["extra"] = {k: v for k, v in saved[0]["extra"].items() if k != "rank_batch_sizes"}  # measured anew
    if ("outer" in state["extra"]) != local_steps:
        return state, None, ""  # the other kind of sync: resume refuses it, naming both
    stepped = list(range(len(saved)))  # the ranks whose optimizer this rank's continues
    if local_steps:  # each node's own optimizer: a new node continues an old one's (its index's, or node 0's)
        old, new = ranks_by_node(marker["node_of_rank"]), ranks_by_node(now["node_of_rank"])
        index = next(i for i, ranks in enumerate(new) if env.rank in ranks)
        stepped = old[index] if index < len(old) else old[0]
        state["extra"]["outer"] = merge_outer_states([saved[ranks[0]]["extra"]["outer"] for ranks in old])
    state["optimizer"] = merge_optimizer_states([saved[r]["optimizer"] for r in stepped])
    loader = carry_over_position([s["loader"] for s in saved], env.rank, env.world_size,
                                 len(row_group_pairs(cfg.data_dir, "train")))
    return state, loader, f"resumed step {step}, {wrote}, re-sharded to {env.world_size} ranks"


def resume(cfg: TrainConfig, env: DistEnv, disks: Disks, model: GPT, opt: MuonAdamW, tokenizer_sha: str,
           vocab_size: int, watchdog: Watchdog, local_steps: bool = False) -> tuple[int, dict | None, dict]:
    """Load the newest checkpoint any disk holds whole into model, opt and the RNG (restoring it first
    to the disks that lack it), refusing one that does not fit; returns (the step to start from, the
    loader's position, the saved `extra`). With local steps the checkpoint is from an outer boundary:
    the model is theta_global, and `extra` holds the outer momentum and the schedule
    (train.setup_local_steps)."""
    everyone = survey(cfg, env, watchdog)
    resume_step = choose_resume_step(cfg, env, everyone)
    if resume_step is None:
        return 0, None, {}
    if env.distributed:
        restore_missing(cfg, env, disks, resume_step, everyone, watchdog)
    marker = next(steps[resume_step] for steps in everyone if resume_step in steps)
    where = step_dir(cfg.out_dir, resume_step)
    fix = f"resume from an older checkpoint by deleting {where} on every node, or {START_AFRESH}"
    try:
        rank_state, loader_state, said = load_states(cfg, env, disks, resume_step, marker, local_steps)
        model_state = load_model_state(cfg.out_dir, resume_step, env.device)
    except Exception as exc:  # noqa: BLE001 - unreadable or unfitting files: name them instead of a traceback
        fail(env, EXIT_CONFIG, f"checkpoint {where} cannot be resumed ({type(exc).__name__}: {exc}); {fix}")
    extra = rank_state.get("extra", {})
    refusal = tokenizer_refusal(cfg, where, extra, tokenizer_sha, vocab_size) or sync_refusal(where, extra,
                                                                                             local_steps)
    if refusal:
        fail(env, EXIT_CONFIG, refusal)
    try:
        model.load_state_dict(model_state)
    except RuntimeError as exc:
        fail(env, EXIT_CONFIG, f"checkpoint {where} does not fit this model (depth {cfg.depth}, vocab "
                               f"{vocab_size}): {str(exc).splitlines()[-1].strip()}; {fix}")
    try:
        opt.load_state_dict(rank_state["optimizer"])
    except ValueError as exc:
        fail(env, EXIT_CONFIG, f"checkpoint {where}: {exc}")
    torch.set_rng_state(rank_state["rng"])
    log(env, said)
    return resume_step, loader_state, extra
