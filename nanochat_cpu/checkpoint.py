"""Saving and resuming a run: every rank's state on every disk, resumed at any layout.

Because every disk holds every rank's state, any one node can resume the whole run: on start the
ranks take the newest step that some disk holds whole, a disk that lacks it (wiped, replaced, a
node just added) gets it from one that has it over the process group, and a world of another
size or shape merges the saved ranks' states and takes its own part (the optimizer re-sharded,
the loader's epoch dealt out anew). A checkpoint that does not fit the run is refused by every
rank (`ResumeTerms`), and `--resume never` refuses a directory that holds checkpoints: a run never
starts afresh silently over an old one.

Beside it: checkpoint_files.py (the files on one disk, written atomically), checkpoint_transfer.py
(which ranks share a disk, bytes between ranks in bounded rounds), checkpoint_background.py (with
local steps, a checkpoint written while the inner steps go on), run_state.py (what a checkpoint
keeps besides tensors).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from . import checkpoint_files
from .checkpoint_files import (
    bad_files,
    checkpoint_root,
    complete_steps,
    fsync_dir,
    list_steps,
    load_model_state,
    load_rank_state,
    mark_complete,
    marker_run_id,
    missing_files,
    prune,
    read_marker,
    step_dir,
    write_step_files,
)
from .checkpoint_transfer import Disks, fail_together, gather_states, on_cpu, send_bytes
from .data import row_group_pairs
from .dataloader import carry_over_position, packing_mismatch
from .dist import EXIT_CONFIG, DistEnv, Watchdog, fail, log
from .optim import merge_optimizer_states
from .run_identity import START_AFRESH, claim, new_run_id, set_aside_others
from .run_state import SAVED_KEY, RunState
from .sync_diloco import merge_outer_states

if TYPE_CHECKING:
    from .dataloader import TokenLoader
    from .model import GPT
    from .optim import MuonAdamW


@dataclass
class Snapshot:
    """A checkpoint's contents as of its step: this rank's state as torch.save bytes, and on a
    disk's writer the weights (a copy of its own where the inner steps go on while it is written:
    checkpoint_background.py)."""

    step: int
    rank_state: bytes
    model_state: dict | None  # None on a rank that writes no disk
    model_cfg: dict  # the model's shape, for the marker
    tokenizer_dir: str  # for the marker: sampling finds the tokenizer there
    state: RunState


def take_snapshot(env: DistEnv, disks: Disks, model: GPT, opt: MuonAdamW, loader: TokenLoader, step: int,
                  state: RunState, tokenizer_dir: str, copy_weights: bool) -> Snapshot:
    buf = io.BytesIO()
    torch.save(on_cpu({"step": step, "optimizer": opt.state_dict(), "loader": loader.state_dict(),
                       "rng": torch.get_rng_state(), SAVED_KEY: state.to_saved()}), buf)
    data = buf.getvalue()
    del buf  # its copy of the bytes: the state is not held twice through the exchange
    weights = None
    if disks.writer(env.rank):
        weights = model.state_dict()
        if copy_weights:
            weights = {k: v.detach().to("cpu", copy=True) for k, v in weights.items()}
    return Snapshot(step, data, weights, dataclasses.asdict(model.cfg), os.path.abspath(tokenizer_dir), state)


def write_checkpoint(env: DistEnv, disks: Disks, snap: Snapshot, watchdog: Watchdog, how: str = "") -> float:
    """Every rank's state to every disk, then sealed on every disk once all of them hold it;
    collective. `how` ends the log line (the background's note). Returns the seconds it took."""
    t0, step = time.perf_counter(), snap.step
    # every disk gets every rank's state: a node that is wiped, added or alone can still resume
    rank_files, crossed = gather_states(env, disks, snap.rank_state, watchdog, step)
    snap.rank_state = b""
    error, digests = None, {}
    stalled = (f"Fix: look at the disk under {disks.out_dir} on {env.host} (`dmesg`, its mount); the unit restarts "
               f"and resumes from the newest sealed checkpoint")
    if disks.writer(env.rank):
        try:
            with watchdog.disk(f"writing checkpoint step {step} to {step_dir(disks.out_dir, step)}", step,
                               stalled) as progress:
                digests = write_step_files(disks.out_dir, step, snap.model_state, rank_files, progress)
        except (OSError, RuntimeError) as exc:  # torch.save reports a failed write as RuntimeError
            done = complete_steps(disks.out_dir)
            error = (f"cannot write checkpoint step {step} under {disks.out_dir}: {type(exc).__name__}: {exc}. "
                     f"Earlier checkpoints are untouched (newest complete: {done[-1] if done else 'none'}). Fix: "
                     f"free space on {env.host} or move --out-dir, then start the run again: it resumes from there")
    del rank_files
    snap.model_state = None
    # instead of a plain barrier: a full disk on one node stops every rank with its reason
    fail_together(env, disks, watchdog, "checkpoint", step, error)
    if disks.writer(env.rank):
        # the model's shape and its tokenizer: what sampling needs besides model.pt, wherever it is copied
        sampling = {"model": snap.model_cfg, "tokenizer_sha256": snap.state.tokenizer_sha256,
                    "tokenizer_dir": snap.tokenizer_dir}
        with watchdog.disk(f"sealing checkpoint step {step} in {step_dir(disks.out_dir, step)}", step, stalled):
            mark_complete(disks.out_dir, step, {**disks.layout(env.hosts or [env.host]), **sampling,
                                                 **snap.state.marker_fields()}, digests, disks.keep)
    took = time.perf_counter() - t0
    log(env, f"checkpoint step {step} saved to {step_dir(disks.out_dir, step)} in {took:.2f}s{crossed}{how}")
    return took


def save_checkpoint(env: DistEnv, disks: Disks, model: GPT, opt: MuonAdamW, loader: TokenLoader, step: int,
                    watchdog: Watchdog, state: RunState, tokenizer_dir: str) -> float:
    """A checkpoint written while every rank waits for it; returns the seconds it took."""
    snap = take_snapshot(env, disks, model, opt, loader, step, state, tokenizer_dir, False)
    return write_checkpoint(env, disks, snap, watchdog)


def tokenizer_refusal(tokenizer_dir: str, where: str, saved: RunState, tokenizer_sha: str,
                      vocab_size: int) -> str | None:
    """Why the checkpoint at `where` (its run state) must not be resumed with this tokenizer."""
    if saved.tokenizer_sha256 in (None, tokenizer_sha):
        return None
    return (f"checkpoint {where} was trained with another tokenizer (sha256 {saved.tokenizer_sha256[:16]}, "
            f"vocab {saved.vocab_size or '?'}) than --tokenizer-dir={tokenizer_dir} "
            f"(sha256 {tokenizer_sha[:16]}, vocab {vocab_size}): its token ids mean other strings. Fix: push the "
            f"run's original tokenizer again (site.yml), or {START_AFRESH}")


def survey(env: DistEnv, disks: Disks, watchdog: Watchdog) -> tuple[list[dict[int, dict]], list[dict[int, tuple]], str]:
    """Every rank's complete checkpoints on its disk ({step: its COMPLETE marker}) and its sealed
    ones that lack files ({step: (the missing names, the run that sealed it)}: deleted or lost since
    they were sealed), by rank; and a new run id drawn by rank 0, for a run whose disks hold none."""
    markers = {s: read_marker(disks.out_dir, s) for s in list_steps(disks.out_dir)}
    mine = {s: marker for s, marker in markers.items() if marker is not None}  # each marker read once
    broken = {s: (lacking, marker_run_id(disks.out_dir, s)) for s in markers
              if s not in mine and (lacking := missing_files(disks.out_dir, s))}
    drawn = new_run_id() if env.rank == 0 else ""
    if not env.distributed:
        return [mine], [broken], drawn
    everyone: list = [None] * env.world_size
    with watchdog.phase("all_gather checkpoint steps", 0):
        dist.all_gather_object(everyone, (mine, broken, drawn), group=disks.group)
    return [complete for complete, _, _ in everyone], [lacking for _, lacking, _ in everyone], everyone[0][2]


def holdings(env: DistEnv, everyone: list[dict[int, dict]]) -> str:
    hosts = env.hosts or [env.host]
    return "; ".join(f"rank {r}@{hosts[r]}: steps {sorted(steps) or 'none'}" for r, steps in enumerate(everyone))


def choose_resume_step(resume: str, out_dir: str, env: DistEnv, everyone: list[dict[int, dict]],
                       broken: list[dict[int, list]]) -> int | None:
    """The newest step some disk holds whole; None for a fresh run. A checkpoint sealed by an older
    version holds only its node's ranks' files: it counts only where every rank's disk has it.
    A sealed step that no disk holds whole (`broken`: survey's) is never trained over silently:
    older than a whole one it is passed over, newer it is named, and with no whole step to go
    back to, the run stops. `resume`: --resume (never: a directory that holds checkpoints is refused)."""
    if resume == "never":
        if any(everyone) or any(broken):
            fail(env, EXIT_CONFIG, f"--resume never, but {out_dir} already holds this run's checkpoints "
                                   f"({holdings(env, everyone)}): a fresh run would mix with them and prune them. "
                                   f"Fix: another --run-name or --out-dir for a new run, or --resume auto to go on "
                                   f"with this one")
        return None
    usable = set()
    for steps in everyone:
        usable |= {s for s, marker in steps.items() if "world_size" in marker}
    usable |= set.intersection(*(set(steps) for steps in everyone))
    if not usable and any(everyone):  # only an older version's checkpoints, and not on every disk
        fail(env, EXIT_CONFIG, f"{out_dir} holds checkpoints written by an older version "
                               f"({holdings(env, everyone)}), which kept each node's own ranks' files only: "
                               f"they resume only on the nodes that wrote them. Fix: resume once on those nodes "
                               f"until the next checkpoint (it holds every rank's state), then change the "
                               f"cluster; or {START_AFRESH}")
    newest = max(usable) if usable else None
    lost = incomplete_everywhere(env, broken, usable, newest)
    if lost and newest is None:
        fail(env, EXIT_CONFIG, f"every checkpoint under {out_dir} was sealed and has since lost files on every "
                               f"disk ({lost}): none can be resumed, and starting at step 1 would train over "
                               f"them. Fix: put the missing files back (a backup, or a disk of this run not in "
                               f"the group now), or {START_AFRESH}")
    if lost and env.master:
        log(env, f"WARNING: checkpoints newer than step {newest} were sealed and have since lost files on every "
                 f"disk ({lost}): resuming from step {newest}, the newest one whole; the steps after it are redone")
    return newest


def incomplete_everywhere(env: DistEnv, broken: list[dict[int, list]], usable: set[int], newest: int | None) -> str:
    """The sealed steps newer than `newest` that no disk holds whole, each disk's missing files
    named ("step 12: node0 lacks rank1.pt"); empty when there are none."""
    hosts = env.hosts or [env.host]
    lacking: dict[int, dict[str, list]] = {}
    for rank, steps in enumerate(broken):
        for step, names in steps.items():
            if step not in usable and (newest is None or step > newest):
                lacking.setdefault(step, {})[hosts[rank]] = names  # ranks that share a disk say the same
    return "; ".join(f"step {step}: " + ", ".join(f"{host} lacks {', '.join(names)}" for host, names in by_host.items())
                     for step, by_host in sorted(lacking.items()))


def restore_missing(env: DistEnv, disks: Disks, step: int, everyone: list[dict[int, dict]],
                    watchdog: Watchdog) -> None:
    """The disks that lack checkpoint `step` (wiped, replaced, or a node just added) get it from the
    lowest rank that has it, file by file over the process group, before anyone loads it."""
    holders = [r for r, steps in enumerate(everyone) if step in steps]
    needy = [r for r in disks.writers if step not in everyone[r]]
    if not needy:
        return
    source, marker, t0 = holders[0], everyone[holders[0]][step], time.perf_counter()
    d, problem, size = step_dir(disks.out_dir, step), None, 0
    if env.rank in needy:  # nothing unsealed of this step is kept
        shutil.rmtree(d, ignore_errors=True)
    for n in needy:
        if env.rank not in (source, n):
            continue
        for name in marker["files"]:  # one file in memory at a time
            data = Path(d, name).read_bytes() if env.rank == source else b""
            got = send_bytes(env, disks, data, source, n, watchdog, f"checkpoint step {step}'s {name}")
            if got is not None and problem is None:
                size += len(got)
                problem = (arrived_other_bytes(step, name, got, marker, env)
                           or write_restored_file(disks.out_dir, step, name, got, env, watchdog))
    if env.rank in needy and problem is None:
        problem = write_restored_file(disks.out_dir, step, "COMPLETE", json.dumps(marker).encode(), env, watchdog)
        fsync_dir(checkpoint_root(disks.out_dir))
        prune(disks.out_dir, disks.keep, sealed=step)
        log(env, f"checkpoint step {step} was missing on this disk: restored from rank {source}@"
                 f"{env.hosts[source]} ({size / 2**20:.0f} MiB in {time.perf_counter() - t0:.1f}s)")
    fail_together(env, disks, watchdog, "checkpoint restore", 0, problem)


def arrived_other_bytes(step: int, name: str, got: bytes | bytearray, marker: dict, env: DistEnv) -> str | None:
    """Why a restored file must not be written: its bytes are not those its marker sealed."""
    sealed = (marker.get("sha256") or {}).get(name)
    if sealed is None or hashlib.sha256(got).hexdigest() == sealed:
        return None
    return (f"checkpoint step {step}'s {name} arrived on {env.host} with other bytes than the sha256 sealed with it: "
            f"the link or the sending disk altered it. Fix: look at both hosts (`dmesg`), then start the run again")


def write_restored_file(out_dir: str, step: int, name: str, data: bytes | bytearray, env: DistEnv,
                        watchdog: Watchdog) -> str | None:
    """One file of a restored checkpoint, atomically (COMPLETE, the last, seals it); the problem, if any."""
    d = step_dir(out_dir, step)
    try:
        with watchdog.disk(f"restoring checkpoint step {step}'s {name} to {d}", step,
                           f"Fix: look at the disk under {out_dir} on {env.host} (`dmesg`, its mount)") as progress:
            os.makedirs(d, exist_ok=True)
            # through its module: the fault tests sabotage the one writer every checkpoint file goes through
            checkpoint_files.atomic_write_bytes(os.path.join(d, name), data, progress)
            if name == "COMPLETE":
                fsync_dir(d)
    except OSError as exc:
        return (f"cannot restore checkpoint step {step} under {out_dir}: {type(exc).__name__}: {exc}. Fix: free "
                f"space on {env.host} (about {len(data) / 2**20:.0f} MiB a file) or move --out-dir, then start "
                f"the run again")
    return None


def sync_refusal(where: str, saved: RunState, local_steps: bool) -> str | None:
    """Why a checkpoint (its run state) must not be resumed by this kind of sync. Local steps go
    on from a synchronous checkpoint (every node continues the whole optimizer state: the end of
    the synchronous warm-up); the reverse would have to pick one node's inner state, so it is refused."""
    if not saved.local_steps or local_steps:
        return None
    return (f"checkpoint {where} was trained with local steps (--sync-every above 1 or auto, past its "
            f"--sync-warmup-ratio), this run asks for every step synchronous (--sync-every 1, or a step still "
            f"inside a longer --sync-warmup-ratio): each node kept its own optimizer state, which one step "
            f"cannot continue. Fix: resume with the run's --sync-every and --sync-warmup-ratio, or {START_AFRESH}")


def ranks_by_node(node_of_rank: list[int]) -> list[list[int]]:
    """The ranks of each launcher, in launcher order (as sync_diloco.find_nodes groups them)."""
    by_node: dict[int, list[int]] = {}
    for rank, node in enumerate(node_of_rank):
        by_node.setdefault(node, []).append(rank)
    return [by_node[n] for n in sorted(by_node)]


def load_states(env: DistEnv, disks: Disks, step: int, marker: dict, local_steps: bool, strategy: str,
                data_dir: str | None) -> tuple[dict, RunState, dict | None, str]:
    """This rank's optimizer state and RNG, the run state, the loader position from checkpoint `step`, and how it
    was laid out. The same layout, stepped the same way, loads the rank's own file as it was saved
    (the resumed run repeats the uninterrupted one exactly); another merges every saved rank's state
    and takes its part. `data_dir` None: the data changed, no position is carried over."""
    where = step_dir(disks.out_dir, step)
    now = disks.layout(env.hosts or [env.host])
    wrote = f"written by {marker.get('world_size', 'this layout of')} ranks on hosts " \
            f"{', '.join(sorted(set(marker.get('hosts', now['hosts']))))}"
    if "world_size" not in marker or (marker["world_size"], marker["node_of_rank"]) == (now["world_size"],
                                                                                     now["node_of_rank"]):
        state = load_rank_state(disks.out_dir, step, env.rank)
        # the same world may step another way (shared memory now missing, or back; local steps after
        # the synchronous warm-up): then merge
        run_state = RunState.of_rank_file(state)
        same_kind = run_state.local_steps == local_steps
        if "world_size" not in marker or (same_kind and state["optimizer"].get("strategy", strategy) == strategy):
            loader = state["loader"] if data_dir is not None else None
            return state, run_state, loader, f"resumed from checkpoint step {step} ({where}), {wrote}"
    saved = [load_rank_state(disks.out_dir, step, r) for r in range(marker["world_size"])]
    state = dict(saved[min(env.rank, len(saved) - 1)])
    # the work split is the ranks' own: kept where the same ranks on the same hosts merge only to
    # step another way (local steps after synchronous ones), measured anew for another layout; and
    # checked again against the inner steps, whose speeds differ from synchronous steps'
    same_ranks = all(marker.get(k) == now[k] for k in ("world_size", "node_of_rank", "hosts"))
    run_state = RunState.of_rank_file(saved[0])
    if not same_ranks:
        run_state.rank_batch_sizes = None
    if local_steps and not run_state.local_steps:
        run_state.split_settled = False
    if run_state.local_steps and not local_steps:
        return state, run_state, None, ""  # local steps continued synchronously: resume refuses it, naming both
    # the ranks whose optimizer this rank's continues: all of them (synchronous steps, or the local
    # steps that follow them: every node continues the whole state), or one old node's
    stepped = list(range(len(saved)))
    if run_state.local_steps:  # a new node continues an old one's (its index's, or node 0's)
        old, new = ranks_by_node(marker["node_of_rank"]), ranks_by_node(now["node_of_rank"])
        index = next(i for i, ranks in enumerate(new) if env.rank in ranks)
        stepped = old[index] if index < len(old) else old[0]
        run_state.outer = merge_outer_states([RunState.of_rank_file(saved[ranks[0]]).outer for ranks in old])
    state["optimizer"] = merge_optimizer_states([saved[r]["optimizer"] for r in stepped])
    loader = None if data_dir is None else carry_over_position([s["loader"] for s in saved], env.rank,
                                                               env.world_size, len(row_group_pairs(data_dir, "train")))
    return state, run_state, loader, f"resumed step {step}, {wrote}, re-sharded to {env.world_size} ranks"


@dataclass
class ResumeTerms:
    """What a checkpoint must fit to be resumed by this run, and where its train shards are (a
    position carried to another world size deals out their row groups)."""

    tokenizer_dir: str
    tokenizer_sha: str
    vocab_size: int
    depth: int
    packing: str
    data_dir: str
    data_sha: str  # the manifest's sha256: what checkpoints record of the data
    data_changed: bool  # --data-changed: a checkpoint of other data resumes, its loader position dropped


def data_refusal(where: str, marker: dict, terms: ResumeTerms) -> str | None:
    """Why the checkpoint at `where` (its marker) must not be resumed on this data."""
    sealed = marker.get("data_sha256")
    if sealed in (None, terms.data_sha) or terms.data_changed:
        return None
    return (f"checkpoint {where} was trained on other data (manifest sha256 {sealed[:16]}) than --data-dir="
            f"{terms.data_dir} holds now (manifest sha256 {terms.data_sha[:16]}): its loader position would point "
            f"into other rows. Fix: push the run's dataset again (site.yml), or go on with the new data on purpose "
            f"with --data-changed (train.yml: -e train_extra_args=--data-changed), which starts the loader at the "
            f"new data's beginning; or {START_AFRESH}")


def load_into(env: DistEnv, disks: Disks, model: GPT, opt: MuonAdamW, step: int, marker: dict, local_steps: bool,
              terms: ResumeTerms) -> tuple[str | None, dict | None, RunState, str]:
    """Checkpoint `step` into model, opt and the RNG: (why it cannot be, or None; the loader's
    position; the run state; the line that says where it came from)."""
    where = step_dir(disks.out_dir, step)
    fix = f"resume from an older checkpoint by deleting {where} on every node, or {START_AFRESH}"
    refusal = data_refusal(where, marker, terms)
    if refusal:
        return refusal, None, RunState(), ""
    same_data = marker.get("data_sha256") in (None, terms.data_sha)
    try:
        rank_state, saved, loader_state, said = load_states(env, disks, step, marker, local_steps, opt.sync.name,
                                                            terms.data_dir if same_data else None)
        model_state = load_model_state(disks.out_dir, step, env.device)
    except Exception as exc:  # noqa: BLE001 - unreadable or unfitting files: name them instead of a traceback
        return f"checkpoint {where} cannot be resumed ({type(exc).__name__}: {exc}); {fix}", None, RunState(), ""
    refusal = (tokenizer_refusal(terms.tokenizer_dir, where, saved, terms.tokenizer_sha, terms.vocab_size)
               or sync_refusal(where, saved, local_steps))
    packing = packing_mismatch(loader_state, terms.packing) if loader_state is not None else None
    refusal = refusal or (f"checkpoint {where}: {packing}" if packing else None)
    if refusal:
        return refusal, None, RunState(), ""
    try:
        model.load_state_dict(model_state)
    except RuntimeError as exc:
        return (f"checkpoint {where} does not fit this model (depth {terms.depth}, vocab {terms.vocab_size}): "
                f"{str(exc).splitlines()[-1].strip()}; {fix}"), None, RunState(), ""
    try:
        opt.load_state_dict(rank_state["optimizer"])
    except ValueError as exc:
        return f"checkpoint {where}: {exc}", None, RunState(), ""
    torch.set_rng_state(rank_state["rng"])
    if not same_data:
        said += (f"; onto other data (--data-changed: manifest sha256 {marker['data_sha256'][:16]} then, "
                 f"{terms.data_sha[:16]} now): the loader starts the new data at its beginning")
    return None, loader_state, saved, said


def find_resume_step(resume: str, run_id: str, env: DistEnv, disks: Disks,
                     watchdog: Watchdog) -> tuple[tuple[int | None, list[dict[int, dict]]], str]:
    """The newest step of this run some disk holds whole, its bytes checked (None: a fresh run), and
    every rank's checkpoints of this run; and the run's id (`run_id`: --run-id, or '' to take the
    checkpoints' or a new one). Other runs' checkpoints are set aside first (run_identity.py). The
    trainer needs the step before it builds the optimizer (synchronous, or local steps past the
    warm-up). `resume`: --resume."""
    everyone, broken, drawn = survey(env, disks, watchdog)
    if resume == "never":  # refuses any checkpoint, whoever wrote it
        choose_resume_step(resume, disks.out_dir, env, everyone, [{s: names for s, (names, _) in lost.items()}
                                                                 for lost in broken])
    claimed = claim(run_id, drawn, env, disks.out_dir, everyone, broken)
    set_aside_others(env, disks, claimed, watchdog)
    while True:
        step = choose_resume_step(resume, disks.out_dir, env, claimed.everyone, claimed.broken)
        if step is None or check_bytes(env, disks, step, claimed.everyone, claimed.broken, watchdog):
            return (step, claimed.everyone), claimed.run_id


def check_bytes(env: DistEnv, disks: Disks, step: int, everyone: list[dict[int, dict]],
                broken: list[dict[int, list]], watchdog: Watchdog) -> bool:
    """Each disk's writer checks checkpoint `step`'s files against the sha256 its marker recorded,
    file by file (each a collective of its own: a peer waits for one file's read, not the whole
    checkpoint's). A disk whose copy differs no longer holds it (restore_missing brings it a good
    one); with no good copy anywhere the step is lost on every disk (`broken`) and an older one is
    chosen. Returns whether some disk holds it good; collective."""
    sealed = next(steps[step] for steps in everyone if step in steps).get("sha256") or {}
    mine = disks.writer(env.rank) and step in everyone[env.rank]
    where = step_dir(disks.out_dir, step)
    fix = f"Fix: look at the disk under {disks.out_dir} on {env.host} (`dmesg`, its mount)"
    bad: dict[int, list[str]] = {}  # writer rank -> its files whose bytes differ
    for name in sealed:
        differs = False
        if mine:
            with watchdog.disk(f"checking the bytes of {where}/{name}", -1, fix) as progress:
                differs = bad_files(disks.out_dir, step, {"sha256": {name: sealed[name]}}, progress) != []
        found = [differs]
        if env.distributed:
            found = [False] * env.world_size
            with watchdog.phase(f"all_gather the sha256 check of checkpoint step {step}'s {name}", 0):
                dist.all_gather_object(found, differs, group=disks.group)
        for w in disks.writers:
            if found[w]:
                bad.setdefault(w, []).append(name)
    if not bad:
        return True
    for rank in range(len(everyone)):
        names = bad.get(disks.disk_of_rank[rank])
        if names:
            everyone[rank].pop(step, None)
            broken[rank][step] = [f"{name} (bytes other than its sha256)" for name in names]
    good = any(step in steps for steps in everyone)
    hosts = env.hosts or [env.host]
    if env.master:
        log(env, f"WARNING: checkpoint step {step}: " + "; ".join(f"{hosts[w]}'s copy of {', '.join(names)}"
                                                                 for w, names in bad.items())
                 + " differ from the sha256 sealed with them (a failing disk, or a file changed since): "
                 + ("those disks get a good copy from one that holds it" if good else "no disk holds a good copy"))
    return good


def load_checkpoint(env: DistEnv, disks: Disks, model: GPT, opt: MuonAdamW, step: int,
                    everyone: list[dict[int, dict]], terms: ResumeTerms, watchdog: Watchdog,
                    local_steps: bool) -> tuple[dict | None, RunState, str]:
    """Checkpoint `step` into model, opt and the RNG, restoring it first to the disks that lack it:
    (the loader's position, the run state, the line that says where it came from). Every rank
    learns whether every rank could load it: one that cannot stops them all."""
    if env.distributed:
        restore_missing(env, disks, step, everyone, watchdog)
    marker = next(steps[step] for steps in everyone if step in steps)
    problem, loader_state, saved, said = load_into(env, disks, model, opt, step, marker, local_steps, terms)
    fail_together(env, disks, watchdog, "resume", 0, problem)
    return loader_state, saved, said


def resume(env: DistEnv, disks: Disks, model: GPT, opt: MuonAdamW, found: tuple[int | None, list],
           terms: ResumeTerms, watchdog: Watchdog, local_steps: bool = False) -> tuple[int, dict | None, RunState]:
    """Load `found` (find_resume_step's) into model, opt and the RNG, refusing a checkpoint that does
    not fit; returns (the step to start from, the loader's position, the run state: empty for a
    fresh run). With local steps a local checkpoint is from an outer boundary: the model is
    theta_global, and the run state holds the outer momentum and the schedule."""
    resume_step, everyone = found
    if resume_step is None:
        return 0, None, RunState()
    loader_state, saved, said = load_checkpoint(env, disks, model, opt, resume_step, everyone, terms, watchdog,
                                                local_steps)
    log(env, said)
    return resume_step, loader_state, saved
