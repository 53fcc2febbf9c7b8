"""One run through the cluster's changes, on the add-node scenario's nodes (molecule/README.md).

    before  train.yml on the master and one worker; stop.yml half way between two checkpoints:
            every rank saves the step it stopped after, both units end inactive (not failed) and
            both disks hold that checkpoint whole.
    after   (node2 added and site.yml converged) train.yml with the same run name on three nodes
            resumes at exactly the stop step, re-sharded from 2 ranks to 3, node2 restoring the
            checkpoint its disk lacks; node1's disk is replaced mid-run (its unit SIGKILLed, its
            run directory wiped): the units restart by themselves and resume from the newest
            checkpoint the other disks hold; stop.yml and train.yml again resume at the stop step,
            and the run finishes.

    python molecule/add-node/resume.py before --inventory molecule/add-node/inventory
    python molecule/add-node/resume.py after --inventory molecule/add-node/inventory

The measured times and steps lost go to --report (build/molecule-add-node.json, for
docs/FAULTS.md): `before` starts it, `after` adds to it. Journals, units and waits are the fault
cases' (molecule/faults/nodes.py and runs.py), and so are the run's settings.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "faults"))  # the fault cases' helpers

from nodes import REPO, Cluster, first, log, show_train_failure, steps, wait_for  # noqa: E402
from runs import (  # noqa: E402
    CHECKPOINT_EVERY,
    VOCAB,
    Run,
    check_resume,
    clean_run,
    resume_after,
    wait_mid_interval,
)

# 200 steps: the last fault comes by about step 50 (a stop after step 10, a disk replaced after the
# first checkpoint of three ranks, a stop after the resume), so the run outlasts all of them.
RUN = Run("add-node", 200)
RESUMED = re.compile(r"resumed (?:from checkpoint )?step (\d+)")
STOPPED = re.compile(r"stopped by SIGTERM after step (\d+) of \d+")
RESTORED = r"checkpoint step {} was missing on this disk: restored from rank \d+@\S+"


def seconds(hit: tuple[float, str] | None, t0: float) -> float | None:
    return round(hit[0] - t0, 1) if hit else None


def start_run(c: Cluster) -> tuple[float, float]:
    """train.yml for the run on every node of the inventory: when it began and how long it took."""
    t0 = time.time()
    rc, out, took = c.playbook("train.yml", RUN.vars)
    assert rc == 0, f"train.yml failed:\n{show_train_failure(out)}"
    log(f"train.yml started {RUN.name} on {', '.join(c.nodes)} in {took:.0f}s")
    return t0, round(took, 1)


def assert_whole_everywhere(c: Cluster, step: int, world: int) -> None:
    """Every disk holds checkpoint `step` sealed, with the model and the state of each of the world's ranks."""
    d = f"{RUN.dir}/checkpoints/step_{step:06d}"
    want = ["model.pt", *(f"rank{r}.pt" for r in range(world))]
    for n in c.nodes:
        marker = json.loads(c.sh(n, f"cat {d}/COMPLETE 2>/dev/null || echo '{{}}'"))
        present = c.sh(n, f"ls {d} 2>/dev/null || true").split()
        assert (marker.get("world_size") == world and sorted(marker.get("files", [])) == sorted(want)
                and set(want) <= set(present)), (
            f"{n}: {d} is not a whole checkpoint of {world} ranks: COMPLETE {marker}, files {present}")


def stop_run(c: Cluster, m: dict, since: float, at_least: int, world: int) -> int:
    """stop.yml half way between two checkpoints, once the run is past step `at_least`: every rank
    finishes its step, checkpoints it and exits; the units end inactive, and every disk holds it.
    Returns the stop step; `m` gets the measurements."""
    m["last_step_seen"] = seen = wait_mid_interval(c, RUN.unit, at_least, since)
    t0 = time.time()
    rc, out, took = c.playbook("stop.yml", {"run_name": RUN.name})
    m["stop_yml_s"] = round(took, 1)
    assert rc == 0, f"stop.yml failed:\n{show_train_failure(out)}"
    for n in c.nodes:
        lines = c.journal(n, RUN.unit, t0)
        said = first(lines, STOPPED.pattern)
        u = c.unit(n, RUN.unit)
        assert said, f"{n}: no 'stopped by SIGTERM after step' line after stop.yml: {[msg for _, msg in lines[-8:]]}"
        # exit 5 (a peer was stopped) or 143 (this launcher got SIGTERM): SuccessExitStatus, no restart
        assert u["ActiveState"] == "inactive" and u["Result"] == "success", f"{n}: {RUN.unit} ended {u}"
        m[n] = {"step": int(STOPPED.search(said[1]).group(1)), "exit_status": u["ExecMainStatus"],
                "sigterm_s": seconds(first(lines, r"^Stopping "), t0), "stopped_line_s": seconds(said, t0),
                "exit_s": seconds(first(lines, r"Deactivated successfully|Main process exited|^Stopped "), t0)}
    stopped = {m[n]["step"] for n in c.nodes}
    assert len(stopped) == 1, f"the ranks stopped after different steps: {m}"
    m["stop_step"] = step = stopped.pop()
    trained = steps(c.journal(c.master, RUN.unit, since))[-1][1]
    # the stop step is the last one trained: a resume there loses nothing
    assert trained == step >= seen, f"stopped after step {step}, the master's last step is {trained} (seen {seen})"
    terms = [m[n]["sigterm_s"] for n in c.nodes if m[n]["sigterm_s"] is not None]
    exits = [m[n]["exit_s"] for n in c.nodes if m[n]["exit_s"] is not None]
    m["stop_to_exit_s"] = round(max(exits) - min(terms), 1) if terms and exits else None
    assert_whole_everywhere(c, step, world)
    log(f"stopped after step {step} (seen {seen}): {m['stop_to_exit_s']}s from SIGTERM to the last unit's exit")
    return step


def resume_by_train_yml(c: Cluster, m: dict, stop_step: int, said_want: str) -> float:
    """train.yml again: the master says `said_want`, and its first step is the one after the stop."""
    t0, m["train_yml_s"] = start_run(c)

    def resumed():
        lines = c.journal(c.master, RUN.unit, t0)
        hit = first(lines, RESUMED.pattern)
        trained = steps(lines, after=hit[0]) if hit else []
        return (hit, trained[0]) if trained else None

    (t_res, said), (t_step, step1, loss1) = wait_for("the run to resume and train a step", resumed, 300, every=1)
    m.update(resumed_from=int(RESUMED.search(said).group(1)), resumed=said[:300], first_step=step1,
             resume_s=round(t_res - t0, 1), first_step_s=round(t_step - t0, 1),
             resumed_to_first_step_s=round(t_step - t_res, 1), first_loss_after=loss1)
    m["steps_lost"] = stop_step - m["resumed_from"]
    assert said_want in said, f"the master said {said!r}, not {said_want!r}"
    assert step1 == stop_step + 1, f"stopped after step {stop_step}, the resumed run's first step is {step1}"
    assert loss1 < math.log(VOCAB) - 0.3, f"loss {loss1} after the resume: back at a fresh model's ln {VOCAB}"
    log(f"resumed at step {m['resumed_from']} ({m['resume_s']}s after train.yml began), first step "
        f"{step1} {m['resumed_to_first_step_s']}s later")
    return t0


def replace_disk(c: Cluster, node: str) -> float:
    """The node's disk replaced mid-run: its unit killed outright, then its run directory wiped while
    systemd waits RestartSec to start it again, which it then does by itself."""
    # Killed first, wiped second: the node is down before its disk goes, as when a disk is swapped,
    # and comes back to an empty one. Wiping first would be another fault (a disk vanishing under a
    # live trainer, whose next checkpoint write fails: test_checkpoint's full disk). auto-restart
    # means the cgroup is empty, so nothing of the old trainer writes into the new directory.
    unit = RUN.unit
    substate = f"systemctl show -p SubState --value {unit}"
    t0 = time.time()
    state = c.sh(node, f"systemctl kill -s SIGKILL {unit}; for i in $(seq 100); do "
                       f"[ \"$({substate})\" = auto-restart ] && break; sleep 0.1; done; "
                       f"rm -rf {RUN.dir}; {substate}").strip()
    assert state == "auto-restart", f"{node}: {unit} was {state!r} when its run directory was wiped"
    log(f"{node}: {unit} SIGKILLed and {RUN.dir} wiped in {time.time() - t0:.1f}s")
    return t0


def finish(c: Cluster, m: dict, since: float, started: float) -> None:
    """The run reaches its last step (train.yml began it again at `since`, `before` at `started`): every
    node says done, every unit ended cleanly and disabled itself."""
    wait_for(f"every unit to end (step {RUN.iterations})", lambda: all(
        c.unit(n, RUN.unit)["ActiveState"] in ("inactive", "failed") for n in c.nodes), timeout=600, every=3)
    for n in c.nodes:
        u = c.unit(n, RUN.unit)
        done = first(c.journal(n, RUN.unit, since), rf"done: {RUN.iterations} steps")
        assert done and u["ActiveState"] == "inactive" and u["Result"] == "success", (
            f"{n}: {RUN.unit} ended {u} without 'done: {RUN.iterations} steps'")
        assert u["UnitFileState"] == "disabled", f"{n}: {RUN.unit} is {u['UnitFileState']} after the run finished"
        m[f"{n}_starts"] = sum(msg.startswith("Started nanochat-train") for _, msg in c.journal(n, RUN.unit, started))
    trained = steps(c.journal(c.master, RUN.unit, since))
    m.update(final_step=trained[-1][1], final_loss=trained[-1][2], done_s=round(trained[-1][0] - since, 1))
    assert m["final_step"] == RUN.iterations, f"the master's last step is {m['final_step']}"


# ---- the two phases ----------------------------------------------------------------------------

def before(c: Cluster, report: dict) -> None:
    assert len(c.nodes) == 2, f"expected the master and one worker before node2 is added, found {c.nodes}"
    clean_run(c, RUN)
    report.update(run=RUN.name, iterations=RUN.iterations, checkpoint_every=CHECKPOINT_EVERY,
                  hosts=sorted(c.nodes), world=len(c.nodes))  # nproc_per_node 1 (inventory/local/group_vars)
    t0, took = start_run(c)
    report["started"] = t0
    report["two-nodes"] = m = {"train_yml_s": took}
    stop_run(c, m, t0, CHECKPOINT_EVERY, len(c.nodes))


def after(c: Cluster, report: dict) -> None:
    world = len(c.nodes)
    added = [n for n in c.nodes if n not in report["hosts"]]
    assert world == report["world"] + 1 and len(added) == 1, f"expected one node added to {report['hosts']}: {c.nodes}"

    # the same run name on three nodes: the two ranks' checkpoint re-sharded to three, step for step
    report["grow"] = m = {}
    n_stop = report["two-nodes"]["stop_step"]
    t0 = resume_by_train_yml(c, m, n_stop, f"resumed step {n_stop}, written by {report['world']} ranks on hosts "
                                           f"{', '.join(report['hosts'])}, re-sharded to {world} ranks")
    for n in c.nodes:
        hit = first(c.journal(n, RUN.unit, t0), RESTORED.format(n_stop))
        # only the new node lacked it: the others resumed from their own disks
        assert (hit is not None) == (n in added), f"{n}: restored {hit}, added {added}"
        if hit:
            m[f"{n}_restored"] = hit[1][:300]

    # node1's disk replaced after the first checkpoint the three ranks wrote
    node = c.workers[0]
    report["disk-replaced"] = m = {
        "killed_after_step": wait_mid_interval(c, RUN.unit, (n_stop // CHECKPOINT_EVERY + 1) * CHECKPOINT_EVERY, t0)}
    t_kill = replace_disk(c, node)
    m.update(resume_after(c, RUN.unit, t_kill, node, timeout=420))
    check_resume(c, RUN.unit, t_kill, m, node, report["started"])
    hit = first(c.journal(node, RUN.unit, t_kill), RESTORED.format(m["resumed_from"]))
    assert hit, f"{node}: no line saying it restored checkpoint step {m['resumed_from']} onto its new disk"
    m["restored"] = hit[1][:300]
    log(f"disk replaced on {node}: resumed from step {m['resumed_from']}, {m['steps_lost']} steps lost")

    # stopped again and started again: not a step lost; then the run finishes
    resumed_from = m["resumed_from"]
    report["stop-resume"] = m = {}
    s_stop = stop_run(c, m, t_kill, resumed_from + 3, world)
    t1 = resume_by_train_yml(c, m, s_stop, f"resumed from checkpoint step {s_stop} (")
    report["final"] = m = {}
    finish(c, m, t1, report["started"])
    log(f"run finished: {json.dumps(report['final'])}")


PHASES = {"before": before, "after": after}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("phase", choices=PHASES)
    parser.add_argument("--inventory", type=Path, default=HERE / "inventory",
                        help="the scenario's inventory dir, with its generated hosts.yml")
    parser.add_argument("--report", type=Path, default=REPO / "build" / "molecule-add-node.json",
                        help="JSON file of the measurements (default: build/molecule-add-node.json)")
    args = parser.parse_args()
    report = {}
    if args.phase == "after":
        if not args.report.exists():
            sys.exit(f"no {args.report}: run `before` first (it stops the two-node run that `after` resumes)")
        report = json.loads(args.report.read_text())
        report.pop("failed", None)  # an earlier attempt's
    try:
        PHASES[args.phase](Cluster(args.inventory), report)
    except AssertionError as exc:
        report["failed"] = f"{args.phase}: {exc}"[:2000]
        raise
    finally:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(json.dumps(report, indent=1) + "\n")
        log(f"measurements: {args.report}")


if __name__ == "__main__":
    main()
