"""Node loss: one run, six faults in turn.

train.yml again while it runs (nothing to start, nothing touched), then the FAULTS_EVENTS faults, in order
(default all five): SIGKILL of a worker's trainer; a worker away and back three ways (its container
stopped and started: a shutdown; systemd's suspend and the wake: a laptop's lid; its container
paused and unpaused: a frozen or cut-off node), the others training on without it meanwhile; SIGKILL
of the master's trainer. After each: the survivors' workers exit, their launchers re-form the group,
the run resumes from the last complete checkpoint (steps lost <= the checkpoint interval; none after
a graceful leave), its losses repeat the ones computed before the fault (the curve goes on, no reset
to ln(vocab)), and in the end it reaches its final step. The finished run stays on the nodes: the
drift and inputs cases use it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
from nodes import Cluster, first, log, podman, show_train_failure, steps, wait_for
from runs import (
    CHECKPOINT_EVERY,
    RESUMED,
    Run,
    check_resume,
    clean_run,
    kill_mid_interval,
    last_step,
    resume_after,
    run_state,
    wait_active,
    wait_mid_interval,
    wait_step,
    world_steps,
)

CASE = "node-loss"
pytestmark = pytest.mark.incremental  # one run throughout: a fault it did not recover from spoils the rest

EVENTS = ("kill-worker", "stop-worker", "suspend-worker", "pause-worker", "kill-master")
# ~0.6 s a step with node1 (the slow link), 0.15-0.2 s without it: still running after the refused
# train.yml and every fault, node1's absences and returns (about 25 s, ROOM_TO_REJOIN steps) included.
# Without an absence (the default scenario's kills) a shorter run holds both kills with room to spare,
# and the case does not wait minutes for steps nothing happens in.
ITERATIONS = 500
ITERATIONS_WITHOUT_ABSENCES = 200
ROOM_TO_REJOIN = 150


def chosen_events() -> list[str]:
    """FAULTS_EVENTS: the faults, in order, comma-separated (FAULTS_EVENTS=kill-worker keeps only the first)."""
    events = [e for e in os.environ.get("FAULTS_EVENTS", "").split(",") if e] or list(EVENTS)
    bad = set(events) - set(EVENTS)
    if bad:
        raise pytest.UsageError(f"unknown FAULTS_EVENTS {sorted(bad)}; choose from {', '.join(EVENTS)}")
    return events


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "event" in metafunc.fixturenames:
        metafunc.parametrize("event", chosen_events())


@dataclass
class Progress:
    run: Run
    at_least: int = CHECKPOINT_EVERY  # the next fault waits for this step: a checkpoint past the last resume
    last_fault: float = 0.0  # the run's "done" lines are looked for after it


@pytest.fixture(scope="module")
def loss_run(cluster: Cluster) -> Iterator[Progress]:
    run = Run("faults-loss", ITERATIONS if set(chosen_events()) & set(ABSENCES) else ITERATIONS_WITHOUT_ABSENCES)
    clean_run(cluster, run)
    yield Progress(run)
    # a run the case left behind would refuse the next cases' train.yml (a run is active): stop it,
    # keeping its files (drift and inputs use them); a finished run's units are already inactive
    for n in cluster.nodes:
        cluster.sh(n, f"systemctl stop {run.unit}", check=False)


def test_train_yml_starts_the_run(cluster: Cluster, loss_run: Progress, case_report: dict) -> None:
    run = loss_run.run
    run.started = loss_run.last_fault = time.time()
    rc, out, took = cluster.playbook("train.yml", run.vars)
    assert rc == 0, f"train.yml failed:\n{show_train_failure(out)}"
    log(f"train.yml started {run.name} in {took:.0f}s")
    case_report["train_yml_s"] = round(took, 1)
    case_report["train_yml_slowest_tasks"] = slowest_tasks(out)
    wait_step(cluster, run.unit, 3, run.started, timeout=300)
    lines = steps(cluster.journal(cluster.master, run.unit, run.started))
    case_report["train_yml_to_step1_s"] = round(lines[0][0] - run.started, 1)
    case_report["step_s"] = round((lines[-1][0] - lines[0][0]) / max(1, lines[-1][1] - lines[0][1]), 2)


def test_second_train_yml_touches_nothing(cluster: Cluster, loss_run: Progress, case_report: dict) -> None:
    """train.yml again, the same settings, while the run trains on every node: no node is out of
    it, so nothing starts, nothing stops, and the playbook says so."""
    unit = loss_run.run.unit
    before = {n: (cluster.unit(n, unit)["InvocationID"], cluster.trainers(n)) for n in cluster.nodes}
    rc, out, took = cluster.playbook("train.yml", loss_run.run.vars)
    assert rc == 0, f"train.yml again during the run failed:\n{show_train_failure(out)}"
    flat = " ".join(out.split())
    assert "already trains on" in flat and "nothing to start" in flat, (
        f"train.yml again did not say the run goes on untouched:\n{out[-3000:]}")
    after = {n: (cluster.unit(n, unit)["InvocationID"], cluster.trainers(n)) for n in cluster.nodes}
    assert after == before, f"train.yml again changed the running units: {before} -> {after}"
    assert all(len(p) == 1 for _, p in after.values()), f"not exactly one trainer per node: {after}"
    case_report["rerun_untouched"] = {
        "seconds": round(took, 1),
        "message": next((ln.strip() for ln in out.splitlines() if "already trains on" in ln), "")[:400]}
    log(f"train.yml again took {took:.0f}s; units untouched")


# Connects to each (address, port) of argv at once, 3 s each: {"address:port": "connected" or the error}.
PROBE = """
import json, socket, sys, concurrent.futures as cf
def knock(target):
    s = socket.socket(); s.settimeout(3)
    try:
        s.connect((target.split(":")[0], int(target.split(":")[1]))); return "connected"
    except OSError as e:
        return type(e).__name__
    finally:
        s.close()
with cf.ThreadPoolExecutor(16) as pool:
    print(json.dumps(dict(zip(sys.argv[1:], pool.map(knock, sys.argv[1:])))))
"""


def test_with_ufw_off_the_trainer_unit_still_admits_only_the_nodes(cluster: Cluster, loss_run: Progress,
                                                                    case_report: dict) -> None:
    """ufw disabled on the master while the run trains (an admin debugging): an intruder on the LAN
    reaches none of the trainer's listening ports (the rendezvous and every rank's Gloo sockets),
    nor the MLflow server's where it runs, for each unit's own IP filter (IPAddressDeny=any,
    IPAddressAllow= the nodes, and MLflow's clients) drops its packets; a listener outside the units
    on the same node it reaches (so ufw is off and the probe can fail), and the run trains on."""
    node, run = cluster.master, loss_run.run
    address = cluster.hostvars[node]["node_ipv4"]
    pids = [p.split("/")[2] for p in cluster.sh(node, f"grep -l '/{run.unit}$' /proc/[0-9]*/cgroup",
                                                 check=False).split()]  # the unit's processes
    listening = cluster.sh(node, "ss -ltnpH")
    ports = sorted({int(m.group(1)) for line in listening.splitlines() if any(f"pid={p}," in line for p in pids)
                    for m in [re.search(r":(\d+)\s", line)] if m})
    assert cluster.master_port in ports and len(ports) >= 2, f"the trainer's ports on {node}: {ports}\n{listening}"
    if cluster.sh(node, "systemctl is-active nanochat-mlflow", check=False).strip() == "active":
        ports.append(int(cluster.hostvars[node].get("mlflow_port", 5000)))
    outside = 29599
    intruder = f"{cluster.name}-intruder"
    network = f"{cluster.name}-lan"  # cluster/up.yml's local_network
    ip = cluster.subnet.split("/")[0].rsplit(".", 1)[0] + ".200"
    cluster.sh(node, "ufw disable")
    try:
        cluster.sh(node, f"(runuser -u nanochat -- timeout 60 python3 -m http.server {outside} --bind {address} "
                         ">/dev/null 2>&1 &)")
        podman("run", "--detach", "--replace", f"--name={intruder}", f"--label=org.nanochat.cluster={cluster.name}",
               f"--network={network}", f"--ip={ip}", "localhost/nanochat-node:latest", "sleep", "60")
        time.sleep(1)  # the listener outside the unit
        out = subprocess.run(["podman", "exec", intruder, "python3", "-c", PROBE,
                              *[f"{address}:{p}" for p in [*ports, outside]]],
                             capture_output=True, text=True, timeout=60).stdout
    finally:
        subprocess.run(["podman", "rm", "--force", "--time=0", intruder], capture_output=True, timeout=60)
        cluster.sh(node, "ufw --force enable", check=False)
    got = json.loads(out)
    reached = [t for t, r in got.items() if r == "connected"]
    assert reached == [f"{address}:{outside}"], (
        f"with ufw off on {node}, the intruder {ip} reached {reached} (wanted only the listener outside the unit, "
        f"port {outside}): {got}")
    assert "active" in cluster.sh(node, "ufw status | head -1"), f"ufw not enabled again on {node}"
    wait_step(cluster, run.unit, last_step(cluster, run.unit, run.started) + 2, run.started, timeout=120)
    case_report["unit_ip_filter"] = {"ports": ports, "intruder": got}
    log(f"ufw off on {node}: the intruder reached none of the ports {ports} (the trainer's, MLflow's where it runs), "
        f"and the listener outside the units")


def test_fault_mid_run(cluster: Cluster, loss_run: Progress, case_report: dict, event: str) -> None:
    """One fault, once the run has passed another checkpoint: the run resumes from the last one."""
    run = loss_run.run
    loss_run.last_fault = time.time()
    if event in ABSENCES:
        # the last worker: its absence leaves the pace what it was (node1's slow link sets it), which
        # the run's length counts on; without node1 two nodes of a fast machine train 0.1 s a step
        # and a 500-step run can end before a node is back
        node = cluster.workers[-1]
        m = away_and_back(cluster, run, node, loss_run.at_least, ABSENCES[event])
    else:
        node = cluster.workers[0] if event == "kill-worker" else cluster.master
        t0 = kill_mid_interval(cluster, node, run.unit, loss_run.at_least, run.started)
        m = resume_after(cluster, run.unit, t0, node, timeout=300, state=lambda: run_state(cluster, run))
        check_resume(cluster, run.unit, t0, m, node, run.started)
    case_report[event] = m
    loss_run.at_least = m.get("rejoined_at", m["resumed_from"]) + CHECKPOINT_EVERY
    log(f"{event}: " + json.dumps({k: v for k, v in m.items() if k not in cluster.nodes}))
    assert loss_run.at_least < run.iterations - CHECKPOINT_EVERY, (
        f"the run is too short for the next fault ({run.iterations} steps)")


def test_run_finishes(cluster: Cluster, loss_run: Progress, case_report: dict) -> None:
    """Every node done, units ended cleanly, the final checkpoint complete."""
    run, iters = loss_run.run, loss_run.run.iterations

    def finished():
        return all(first(cluster.journal(n, run.unit, loss_run.last_fault), rf"done: {iters} steps")
                   for n in cluster.nodes) and all(
            cluster.unit(n, run.unit)["ActiveState"] in ("inactive", "failed") for n in cluster.nodes)
    wait_for(f"every node to finish step {iters}", finished, timeout=600, every=3)
    for n in cluster.nodes:
        u = cluster.unit(n, run.unit)
        assert u["ActiveState"] == "inactive" and u["Result"] == "success", f"{n}: {run.unit} ended {u}"
        # a finished run disables itself: it must not start alone at the next boot
        assert u["UnitFileState"] == "disabled", (
            f"{n}: {run.unit} is still {u['UnitFileState']} after the run finished")
        ck = cluster.sh(n, f"cat {run.dir}/checkpoints/step_{iters:06d}/COMPLETE", check=False)
        assert f'"step": {iters}' in ck, f"{n}: no complete checkpoint for step {iters}"
        starts = len([1 for _, msg in cluster.journal(n, run.unit, run.started)
                      if msg.startswith("Started nanochat-train")])
        assert starts <= 5, f"{n}: {starts} starts, StartLimitBurst is 5"
        case_report.setdefault("final", {})[f"{n}_starts"] = starts
    losses = steps(cluster.journal(cluster.master, run.unit, run.started))
    case_report["final"].update(final_step=losses[-1][1], final_loss=losses[-1][2], initial_loss=losses[0][2],
                                wall_s=round(losses[-1][0] - run.started, 1))
    log(f"run finished: {json.dumps(case_report['final'])}")


# ---- a node away and back ----------------------------------------------------------------------

AWAY_STEPS = 8  # steps the others train without the node before it comes back
PEER_TIMEOUT = 30  # the trainer's --peer-timeout (its default): a silent node is noticed within it
# The test's stand-in for the sleep itself, which a container cannot do: systemd-suspend.service
# waits for WAKE_FILE instead of suspending the machine (a drop-in under /run, gone at a reboot).
# Everything around it is systemd's own: suspend.target, sleep.target, the units hooked to them.
SLEEP_DROPIN = "/run/systemd/system/systemd-suspend.service.d/faults-test.conf"
WAKE_FILE = "/run/faults-test-wake"
ASLEEP_FILE = "/run/faults-test-asleep"  # what `systemctl is-active <trainer>` said as the sleep began


def shut_down(c: Cluster, node: str, run: Run) -> None:
    podman("stop", c.ct(node))


def boot(c: Cluster, node: str, run: Run) -> dict:
    """`podman start`: train.yml enabled the run's instance, so its unit starts at boot and the node
    rejoins by itself; nobody starts it by hand."""
    podman("start", c.ct(node))
    c.sh(node, "timeout 120 systemctl is-system-running --wait", check=False)
    autostart = wait_active(c, node, run.unit, 20)
    assert autostart, (f"{node}'s {run.unit} did not start when the node came back "
                       f"(UnitFileState={c.unit(node, run.unit).get('UnitFileState')}): the unit must be enabled")
    return {"autostart": autostart}


def suspend(c: Cluster, node: str, run: Run) -> None:
    """systemd's suspend, as `systemctl suspend` starts it (suspend.target), with the sleep itself
    replaced by a wait for WAKE_FILE."""
    asleep = f"systemctl is-active {run.unit} > {ASLEEP_FILE}; until [ -e {WAKE_FILE} ]; do sleep 0.5; done"
    c.sh(node, f"rm -f {WAKE_FILE} {ASLEEP_FILE}; mkdir -p {SLEEP_DROPIN.rsplit('/', 1)[0]}; "
               f"printf '[Service]\\nExecStart=\\nExecStart=/bin/sh -c \"{asleep}\"\\n' > {SLEEP_DROPIN}; "
               "systemctl daemon-reload; systemctl start --no-block suspend.target")


def wake(c: Cluster, node: str, run: Run) -> dict:
    """The machine wakes: nanochat-wake@<run> starts the run's unit again. The unit had stopped
    before the sleep began (Conflicts=sleep.target), not while the machine slept."""
    since = time.time()
    try:
        c.sh(node, f"touch {WAKE_FILE}")
        wake_unit = run.unit.replace("nanochat-train@", "nanochat-wake@")

        def started_again():
            return wait_active(c, node, run.unit, 1) and first(c.journal(node, wake_unit, since), r"Finished")

        def units():
            return c.sh(node, f"systemctl status --no-pager {wake_unit} {run.unit} suspend.target "
                              "systemd-suspend.service 2>&1 | tail -n 40", check=False)
        woke = wait_for(f"{wake_unit} to start {run.unit} after the wake", started_again, timeout=60, state=units)
        before_sleep = c.sh(node, f"cat {ASLEEP_FILE}", check=False).strip()
        assert before_sleep == "inactive", (
            f"{run.unit} was {before_sleep!r} as {node} went to sleep: the unit must stop before the sleep")
    finally:  # the node's own suspend again, for whatever comes after
        c.sh(node, f"rm -f {SLEEP_DROPIN} {WAKE_FILE} {ASLEEP_FILE}; systemctl daemon-reload", check=False)
    return {"woken_by_unit": bool(woke), "trainer_at_sleep": before_sleep}


def freeze(c: Cluster, node: str, run: Run) -> None:
    podman("pause", c.ct(node))


def thaw(c: Cluster, node: str, run: Run) -> dict:
    podman("unpause", c.ct(node))
    return {}


@dataclass
class Absence:
    """A way for a node to be away: how it leaves, how it comes back, whether it says goodbye."""
    leave: Callable[[Cluster, str, Run], None]
    back: Callable[[Cluster, str, Run], dict]
    graceful: bool


ABSENCES = {
    # a laptop shut down: systemd stops the unit, the ranks stop at a checkpoint together
    "stop-worker": Absence(shut_down, boot, graceful=True),
    # a laptop's lid closed: the same, hooked to sleep.target; the wake unit starts it again
    "suspend-worker": Absence(suspend, wake, graceful=True),
    # a laptop frozen, or off the WiFi: nothing says goodbye, the others notice the silence
    "pause-worker": Absence(freeze, thaw, graceful=False),
}


def away_and_back(c: Cluster, run: Run, node: str, at_least: int, how: Absence) -> dict:
    """A worker away mid-run: the others go on without it (at once, losing no step, after a graceful
    leave; within --peer-timeout, losing at most a checkpoint interval, after a silent one). Back
    once they have trained AWAY_STEPS steps without it, it joins at a checkpoint the others stop
    at, costing no step."""
    unit = run.unit
    wait_mid_interval(c, unit, at_least, run.started)
    world, last = world_steps(c.journal(c.master, unit, run.started), run.started)[-1][1:]
    assert run.iterations - last >= ROOM_TO_REJOIN, (
        f"the run is too short to see {node} come back: step {last} of {run.iterations} (ITERATIONS)")
    t0 = time.time()
    how.leave(c, node, run)
    left_s = time.time() - t0
    log(f"{how.leave.__name__} {node} took {left_s:.1f}s")
    try:
        alone, away, m = train_without(c, run, node, t0, world, how.graceful)
        if how.leave is shut_down:
            m["status_yml"] = status_while_away(c, run, node)
    finally:  # back in any case: the cases after this one need every node
        t_back = time.time()
        came_back = how.back(c, node, run)

    def all_again():
        lines = c.journal(c.master, unit, t_back)
        back = [s for s in world_steps(lines, t_back) if s[1] == world]
        return (lines, back[0]) if back else None
    lines, (t_all, _, first_all) = wait_for(f"{node} to train with the others again", all_again, timeout=300, every=3,
                                            state=lambda: run_state(c, run))
    stop = first(lines, r"stopped by SIGTERM after step \d+")
    rejoin = first(lines, RESUMED)
    assert stop and rejoin, f"{node} joined without a stop at a checkpoint and a resume: {lines[-20:]}"
    stop_step = int(re.search(r"after step (\d+)", stop[1]).group(1))
    rejoin_step = int(re.search(r"step (\d+)", rejoin[1]).group(1))
    assert rejoin_step == stop_step and first_all == stop_step + 1, (
        f"{node} rejoined at step {rejoin_step} after a stop at {stop_step}, first step together {first_all}")
    for n, u in away.items():
        assert u["ActiveState"] in ("active", "activating"), f"{n} gave up while {node} was away: {u}"
    m.update(came_back, node=node, leave_s=round(left_s, 1), trained_without_s=round(alone[0][0] - t0, 1),
             steps_without=alone[-1][2] - alone[0][2] + 1, back_after_s=round(t_back - t0, 1),
             rejoined_at=rejoin_step, rejoin_s=round(t_all - t_back, 1),
             survivors_while_away={n: f"{u['ActiveState']}/{u['SubState']}" for n, u in away.items()})
    return m


def status_while_away(c: Cluster, run: Run, node: str) -> str:
    """status.yml while `node` is shut down: a row of its own, and the master's summary naming it
    away since the step it left at."""
    rc, out, took = c.playbook("status.yml", {"run_name": run.name})
    assert re.search(rf"^\s*{node}\s+\d+\s+{run.name}\s+unreachable", out, flags=re.MULTILINE), (
        f"status.yml has no row for the away {node}:\n{out[-4000:]}")
    said = re.search(rf"{run.name}: in the group now [^\n\"]*away: {node} \(out since step \d+[^)]*\)",
                     " ".join(out.split()))
    assert said, f"status.yml's summary does not say since when {node} is away:\n{out[-4000:]}"
    log(f"status.yml in {took:.0f}s: {said.group(0)}")
    return said.group(0)


def train_without(c: Cluster, run: Run, node: str, t0: float, world: int, graceful: bool) -> tuple[list, dict, dict]:
    """The others, after `node` left at t0: AWAY_STEPS steps at a smaller world. After a graceful
    leave they stopped at a checkpoint with it, losing no step; after a silent one a survivor named
    it, within --peer-timeout."""
    unit = run.unit

    def without_it():
        alone = [s for s in world_steps(c.journal(c.master, unit, t0), t0) if s[1] < world]
        return alone if len(alone) >= AWAY_STEPS else None
    alone = wait_for(f"the others to train {AWAY_STEPS} steps without {node}", without_it, timeout=180, every=2,
                     state=lambda: run_state(c, run))
    away = {n: c.unit(n, unit) for n in c.nodes if n != node}
    m = resume_after(c, unit, t0, node, timeout=60, state=lambda: run_state(c, run))
    check_resume(c, unit, t0, m, node, run.started)
    if graceful:
        assert m["graceful"], f"the others did not stop at a checkpoint with {node}: {m}"
    else:
        noticed = [m[n]["fatal_s"] for n in away if f"@{node} has been silent" in (m[n]["fatal"] or "")]
        assert noticed, f"no survivor said {node} went silent: {[m[n]['fatal'] for n in away]}"
        assert min(noticed) <= PEER_TIMEOUT + 5, (
            f"{node}'s silence was noticed after {min(noticed)} s (--peer-timeout {PEER_TIMEOUT})")
        m["noticed_s"] = min(noticed)
    return alone, away, m


def slowest_tasks(out: str, n: int = 6) -> list[str]:
    """profile_tasks' summary lines ('role : task ---- 12.34s'), slowest first."""
    found = re.findall(r"^(\S.*?) -{2,} ([0-9.]+)s$", out, flags=re.MULTILINE)
    return [f"{name.strip()} {float(sec):.0f}s" for name, sec in found[:n]]
