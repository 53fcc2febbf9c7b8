"""Which run a checkpoint belongs to: every run has an id, and another run's checkpoints are kept
out of its way.

A run's id is `--run-id` (train.yml passes the one the master's env file holds for the run name,
or a new one), or for a run started by hand without it the id its checkpoints hold, or a new one
rank 0 draws. It is kept in every checkpoint's COMPLETE marker and rank files, said in the start
banner and logged to MLflow.

On resume every disk's sealed checkpoints are grouped by the run that wrote them (`claim`). A run
resumes only its own, and those sealed before runs had ids where they are older than its own
first one (its history before the upgrade; with none of its own yet, all of them). Another run's
are named and set aside on their disk under checkpoints/other-runs/<its id>/ (`no-id/` for one
sealed before ids, newer than this run's first), where resume, restore and pruning never look:
nothing of them is deleted. Where the disks do not say which run this is, every rank stops before
step 1 naming the hosts, the ids and the fix, because a guess would train over one of them:
- no disk holds a checkpoint that carries this run's id, but some hold another run's (a laptop
  that kept a run of the same name from an earlier cluster);
- the run was started without an id and the disks hold several runs.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from .checkpoint_files import checkpoint_root, set_aside
from .checkpoint_transfer import Disks, fail_together
from .config import RUN_ID
from .dist import EXIT_CONFIG, DistEnv, Watchdog, fail, log

START_AFRESH = "start afresh with another --run-name or --out-dir"
NO_ID = "no-id"  # another run's checkpoint sealed before runs had ids: set aside under this name
BAD_ID = "unreadable-id"  # a marker whose id is no id (edited by hand, corrupt): never a path


def run_of(marker_id: object) -> str | None:
    """A marker's run id as claim reads it: None where it has none (sealed before ids)."""
    if marker_id is None:
        return None
    return marker_id if isinstance(marker_id, str) and RUN_ID.fullmatch(marker_id) else BAD_ID


def new_run_id() -> str:
    return uuid.uuid4().hex


@dataclass
class Claim:
    """Which run this is, and every rank's disk's checkpoints sorted by run."""

    run_id: str
    everyone: list[dict[int, dict]]  # this run's complete checkpoints on each rank's disk ({step: marker})
    broken: list[dict[int, list]]  # this run's sealed steps that lost files ({step: the missing names})
    others: list[dict[int, str]]  # other runs' sealed steps on each rank's disk ({step: their run id})


def held_runs(env: DistEnv, runs: list[dict[int, str]]) -> str:
    """'node1: steps [40] of run 3f2a…' for every disk's checkpoints of `runs` (ranks that share a disk say it once)."""
    hosts, said = env.hosts or [env.host], {}
    for rank, steps in enumerate(runs):
        for step, run_id in steps.items():
            said.setdefault((hosts[rank], run_id), set()).add(step)
    return "; ".join(f"{host}: steps {sorted(steps)} " + ("sealed before runs had ids" if run_id == NO_ID
                                                          else f"of run {run_id}")
                     for (host, run_id), steps in said.items())


def claim(given: str, drawn: str, env: DistEnv, out_dir: str, everyone: list[dict[int, dict]],
          broken: list[dict[int, tuple[list, str | None]]]) -> Claim:
    """This run's id and its checkpoints among every disk's (`everyone`: {step: marker} by rank;
    `broken`: {step: (missing names, run id)} by rank). `given`: --run-id ('' if none); `drawn`:
    rank 0's new id, for a run whose disks hold none."""
    runs = [{s: run_of(m.get("run_id")) for s, m in steps.items()} | {s: run_of(rid) for s, (_, rid) in lost.items()}
            for steps, lost in zip(everyone, broken, strict=True)]
    ids = {run_id for steps in runs for run_id in steps.values()} - {None}
    if not given and len(ids) > 1:
        fail(env, EXIT_CONFIG, f"{out_dir} holds checkpoints of {len(ids)} runs ({held_runs(env, runs)}) and this "
                               f"run was started without --run-id: which one it is would be a guess. Fix: "
                               f"--run-id <one of them> goes on with that run (the others' checkpoints are set "
                               f"aside under {checkpoint_root(out_dir)}/other-runs, not deleted), or {START_AFRESH}")
    this = given or next(iter(ids), drawn)
    first_own = min((s for steps in runs for s, rid in steps.items() if rid == this), default=None)
    # a step sealed before ids is this run's history if it is older than the run's first step with its id
    others = [{s: rid or NO_ID for s, rid in steps.items()
               if rid != this and not (rid is None and (first_own is None or s < first_own))} for steps in runs]
    own = [{s: m for s, m in steps.items() if s not in theirs} for steps, theirs in zip(everyone, others, strict=True)]
    own_broken = [{s: names for s, (names, _) in lost.items() if s not in theirs}
                  for lost, theirs in zip(broken, others, strict=True)]
    if ids - {this} and first_own is None:
        fail(env, EXIT_CONFIG, f"this is run {this}, and no disk under {out_dir} holds a checkpoint of it, but some "
                               f"hold another run's ({held_runs(env, others)}): starting afresh beside them, or "
                               f"taking them over, would be a guess. Fix: to go on with that run, give its id "
                               f"(train.yml: -e run_id=<id>; by hand: --run-id <id>); to start this one, move that "
                               f"run's directory away on those hosts, or {START_AFRESH}")
    return Claim(this, own, own_broken, others)


def set_aside_others(env: DistEnv, disks: Disks, claimed: Claim, watchdog: Watchdog) -> None:
    """Each disk's writer moves the other runs' checkpoints to checkpoints/other-runs/<id>/ and says
    where; collective (a disk that cannot stops every rank, naming it)."""
    theirs = claimed.others[env.rank] if disks.writer(env.rank) else {}
    problem, moved = None, []
    for step, run_id in sorted(theirs.items()):
        try:
            moved.append(f"step {step} of run {run_id} to {set_aside(disks.out_dir, step, run_id)}")
        except OSError as exc:
            problem = (f"cannot set aside step {step} of another run ({run_id}) under {disks.out_dir}: "
                       f"{type(exc).__name__}: {exc}. Fix: move it away by hand on {env.host}")
            break
    if moved:
        log(env, f"run {claimed.run_id}: checkpoints of another run on this disk set aside, nothing deleted: "
                 f"{'; '.join(moved)}")
    fail_together(env, disks, watchdog, "setting other runs' checkpoints aside", 0, problem)
