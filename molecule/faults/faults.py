#!/usr/bin/env python3
"""Inject the faults of issue 5 into a provisioned local cluster and measure what happens.

    faults.py --inventory molecule/faults/inventory --report build/faults.json CASE [CASE ...]

Cases (molecule/faults/verify.yml runs them in this order; each can run alone on a cluster that
site.yml has converged):

  node-loss   one run, four faults in turn: train.yml again while it runs (refused, the run
              goes on), SIGKILL of a worker's trainer, a worker container stopped for 60 s, SIGKILL
              of the master's trainer. After each: the survivors exit, systemd restarts the
              units, the run resumes from the last complete checkpoint (steps lost <= the
              checkpoint interval), its losses repeat the ones computed before the fault (the
              curve goes on, no reset to ln(vocab)), and in the end it reaches its final step.
  drift       one node's shard modified after site.yml: train.yml stops in the preflight naming
              the host and file, no unit starts; the units started by hand anyway exit on every
              node with the fingerprint message.
  network     a worker's train_interface wrong, another's an interface with only IPv6, and ufw
              on a worker dropping the Gloo range: each stopped by the preflight naming the host,
              the interface or port, and the fix; no unit starts.
  stale       a foreign server on the master's rendezvous port, then a launcher left over from a
              run started by hand on a worker: the preflight names each PID (and the process
              name) with the fix; no unit starts.
  checkpoint  a worker's run directory on a small tmpfs: filled after checkpoint 10, so its write
              of checkpoint 20 fails: every rank stops with exit 2 naming that node and "No space
              left on device" (no restart loop), checkpoint 10 intact everywhere, the partial file
              gone; the units started again after freeing space resume from 10 with the same
              losses; then the worker's trainer SIGKILLed while it writes its next checkpoint: the
              half-written step is ignored, the run resumes from the one before and finishes.
  inputs      bad extra-vars (type, choice, batch arithmetic), a bad trainer flag, a node without
              its data dir, an empty and a corrupt shard pushed consistently, and resuming the
              node-loss run with a tokenizer from another corpus (pytest adds another depth): each refused
              naming the host, value and fix, with no node changed (env files, run dirs, units).

Everything is read from the nodes' journals (timestamps are the host's clock: the containers
share its kernel) and checkpoint directories. Each case appends its measurements to --report
(JSON) and prints them; a failed expectation exits 1 naming it. Standard library + PyYAML (the
controller's Ansible venv) only.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
VOCAB = 4096  # the demo tokenizer (roles/dataset): a fresh model's loss is ln(4096) = 8.32
# A tiny run: every fault case fits the CI budget on 2 cores.
CHECKPOINT_EVERY = 10
COLLECTIVE_TIMEOUT = 60
RUN_VARS = {
    "depth": 2, "max_seq_len": 64, "device_batch_size": 2, "eval_every": 0, "eval_tokens": 384,
    "sample_every": 0, "checkpoint_every": CHECKPOINT_EVERY,
    "train_extra_args": f"--collective-timeout {COLLECTIVE_TIMEOUT}",
}
# a worker's command line, as the launcher (torchrun's agent) starts it with its own interpreter
TRAINER = "python3? -u -m nanochat_cpu.train"
STEP = re.compile(r"\] step (\d+)/(\d+) loss=([0-9.]+|nan|inf)")


class Failed(AssertionError):
    pass


def expect(ok: bool, what: str) -> None:
    if not ok:
        raise Failed(what)


def log(msg: str) -> None:
    print(f"[faults {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- the cluster -----------------------------------------------------------------------------

class Cluster:
    def __init__(self, inventory: Path):
        self.inventory = inventory
        tree = yaml.safe_load((inventory / "hosts.yml").read_text())
        groups = tree["all"]["children"]["cluster"]["children"]
        self.master = next(iter(groups["master"]["hosts"]))
        self.workers = list(groups["workers"]["hosts"])
        self.nodes = [self.master, *self.workers]
        self.hostvars = {**groups["master"]["hosts"], **groups["workers"]["hosts"]}
        self.subnet = tree["all"]["vars"]["lan_subnet"]
        self.master_port = int(tree["all"]["vars"].get("master_port", 29500))

    def ct(self, node: str) -> str:
        return self.hostvars[node]["ansible_host"]

    def sh(self, node: str, cmd: str, check: bool = True, timeout: float = 120) -> str:
        proc = subprocess.run(["podman", "exec", self.ct(node), "bash", "-c", cmd], capture_output=True, text=True,
                              timeout=timeout)
        if check and proc.returncode != 0:
            raise Failed(f"{node}: `{cmd}` exited {proc.returncode}: {proc.stdout[-2000:]}{proc.stderr[-2000:]}")
        return proc.stdout

    def journal(self, node: str, unit: str, since: float = 0.0) -> list[tuple[float, str]]:
        """(time, message) of the unit's journal: the trainer's lines and systemd's about it."""
        out = self.sh(node, f"journalctl -u {unit} -o json --no-pager --since @{since:.6f} "
                            "--output-fields=MESSAGE,__REALTIME_TIMESTAMP", check=False)
        lines = []
        for raw in out.splitlines():
            try:
                entry = json.loads(raw)
            except ValueError:
                continue
            msg = entry.get("MESSAGE", "")
            if isinstance(msg, list):
                msg = bytes(msg).decode("utf-8", "replace")
            lines.append((int(entry["__REALTIME_TIMESTAMP"]) / 1e6, msg))
        return lines

    def unit(self, node: str, unit: str) -> dict[str, str]:
        out = self.sh(node, f"systemctl show {unit} -p ActiveState -p SubState -p NRestarts -p InvocationID "
                            "-p MainPID -p UnitFileState -p Result -p ExecMainStatus", check=False)
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def trainers(self, node: str) -> list[int]:
        out = self.sh(node, f"pgrep -f '^/opt/nanochat/venv/bin/{TRAINER} ' || true")
        return [int(p) for p in out.split()]

    def playbook(self, name: str, run_vars: dict, *extra: str, extra_inventory: Path | None = None,
                 timeout: float = 900) -> tuple[int, str, float]:
        cmd = [str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(self.inventory)]
        if extra_inventory:
            cmd += ["-i", str(extra_inventory)]
        cmd += ["-e", json.dumps(run_vars)]  # JSON: values with spaces stay one value
        cmd += [*extra, name]
        env = dict(os.environ, ANSIBLE_CONFIG=str(REPO / "ansible.cfg"), ANSIBLE_FORCE_COLOR="false")
        env["ANSIBLE_CALLBACKS_ENABLED"] = "ansible.posix.profile_tasks"  # where the time goes
        t0 = time.time()
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        return proc.returncode, proc.stdout + proc.stderr, time.time() - t0


def wait_for(what: str, probe, timeout: float, every: float = 2.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        got = probe()
        if got:
            return got
        time.sleep(every)
    raise Failed(f"timed out after {timeout:.0f}s waiting for {what}")


def first(lines: list[tuple[float, str]], pattern: str, after: float = 0.0) -> tuple[float, str] | None:
    rx = re.compile(pattern)
    return next(((t, m) for t, m in lines if t >= after and rx.search(m)), None)


def steps(lines: list[tuple[float, str]], after: float = 0.0,
          before: float = math.inf) -> list[tuple[float, int, float]]:
    """(time, step, loss) of the master's step lines in [after, before)."""
    out = []
    for t, m in lines:
        if after <= t < before and (hit := STEP.search(m)):
            out.append((t, int(hit.group(1)), float(hit.group(3))))
    return out


def show_train_failure(out: str) -> str:
    """The lines of an ansible-playbook run that say why it failed."""
    keep = [ln for ln in out.splitlines() if re.search(r"fatal:|FAILED|msg:|assertion|=> \{|failed=[1-9]", ln)]
    return "\n".join(keep[-40:]) or out[-3000:]


# ---- node loss -----------------------------------------------------------------------------

def resume_after(c: Cluster, unit: str, t0: float, killed: str | None, timeout: float) -> dict:
    """Wait until the run trains again after a fault injected at t0; measure each phase."""
    survivors = [n for n in c.nodes if n != killed]
    wait_for("the survivors to exit", lambda: all(
        first(c.journal(n, unit, t0), r"FATAL|Main process exited|Failed with result") for n in survivors),
        timeout=COLLECTIVE_TIMEOUT + 60)
    master = c.master

    def resumed():
        lines = c.journal(master, unit, t0)
        hit = first(lines, r"resumed from checkpoint step \d+")
        if hit and steps(lines, after=hit[0]):
            return lines
        return None

    lines = wait_for("the run to resume and train a step", resumed, timeout=timeout, every=3)
    t_res, msg = first(lines, r"resumed from checkpoint step \d+")
    resumed_step = int(re.search(r"step (\d+)", msg).group(1))
    t_step, step1, loss1 = steps(lines, after=t_res)[0]
    m = {"resumed_from": resumed_step, "resume_s": round(t_res - t0, 1), "first_step_s": round(t_step - t0, 1),
         "first_loss_after": loss1}
    for n in c.nodes:
        j = c.journal(n, unit, t0)
        fatal = first(j, r"FATAL")
        exited = first(j, r"Main process exited|Failed with result|Deactivated|Stopped")
        started = first(j, r"Started nanochat-train")
        m[n] = {"fatal_s": round(fatal[0] - t0, 1) if fatal else None,
                "fatal": fatal[1][:300] if fatal else None,
                "exit_s": round(exited[0] - t0, 1) if exited else None,
                "restart_s": round(started[0] - t0, 1) if started else None,
                "restarts": int(c.unit(n, unit).get("NRestarts", "0") or 0)}
    return m


def check_resume(c: Cluster, unit: str, t0: float, m: dict, killed: str | None, since: float) -> None:
    lines = c.journal(c.master, unit, since)  # this run's lines only (a journal outlives a rerun)
    before = {s: loss for _, s, loss in steps(lines, before=t0)}
    last_before = max(before)
    m["last_step_before"] = last_before
    m["steps_lost"] = last_before - m["resumed_from"]
    expect(m["resumed_from"] % CHECKPOINT_EVERY == 0, f"resumed from step {m['resumed_from']}, not a checkpoint")
    expect(0 <= m["steps_lost"] <= CHECKPOINT_EVERY,
           f"lost {m['steps_lost']} steps (last step {last_before}, resumed from {m['resumed_from']}), "
           f"more than --checkpoint-every {CHECKPOINT_EVERY}")
    for n in c.nodes:
        if n == killed:
            continue
        fatal = m[n]["fatal_s"]
        expect(fatal is not None or m[n]["exit_s"] is not None, f"{n} did not exit after the fault")
        bound = COLLECTIVE_TIMEOUT + 30
        expect((fatal or m[n]["exit_s"]) <= bound, f"{n} took {fatal}s to give up (bound {bound}s: "
               f"--collective-timeout {COLLECTIVE_TIMEOUT} + 30)")
    # the resumed run recomputes the lost steps: the same losses (same data, RNG, optimizer
    # state) prove it continued the curve from the checkpoint instead of starting over
    after = {s: loss for _, s, loss in steps(lines, after=t0)}
    redone = [s for s in range(m["resumed_from"] + 1, last_before + 1) if s in after and s in before]
    m["max_loss_diff_redone"] = max((abs(after[s] - before[s]) for s in redone), default=0.0)
    expect(m["max_loss_diff_redone"] < 1e-2, f"losses of the redone steps differ: "
           f"{[(s, before[s], after[s]) for s in redone]}")
    first_loss = m["first_loss_after"]
    expect(first_loss < math.log(VOCAB) - 0.3 and first_loss < before[1] - 0.3,
           f"loss after resume {first_loss} is back near the initial {before[1]} (ln {VOCAB} = {math.log(VOCAB):.2f})")


def kill_trainer(c: Cluster, node: str, unit: str) -> float:
    pid = c.unit(node, unit)["MainPID"]
    workers = c.sh(node, f"pgrep -P {pid} -f nanochat_cpu.train").split()
    expect(len(workers) == 1, f"{node}: expected one trainer under torchrun {pid}, found {workers}")
    t0 = time.time()
    c.sh(node, f"kill -9 {workers[0]}")
    log(f"SIGKILL {node} trainer pid {workers[0]}")
    return t0


def last_step(c: Cluster, unit: str) -> int:
    out = c.sh(c.master, f"journalctl -u {unit} -n 20 -o cat --no-pager", check=False)
    found = [int(m.group(1)) for m in STEP.finditer(out)]
    return found[-1] if found else 0


def wait_step(c: Cluster, unit: str, at_least: int, timeout: float) -> int:
    return wait_for(f"step {at_least}", lambda: (s := last_step(c, unit)) >= at_least and s, timeout, every=1)


def wait_mid_interval(c: Cluster, unit: str, at_least: int, timeout: float = 300) -> int:
    """A step >= at_least half way between two checkpoints: a fault there loses work."""
    def probe():
        s = last_step(c, unit)
        return s if s >= at_least and 3 <= s % CHECKPOINT_EVERY <= CHECKPOINT_EVERY - 3 else None
    return wait_for(f"a step >= {at_least} between checkpoints", probe, timeout, every=0.2)


def clean_run(c: Cluster, run: str) -> None:
    """Forget an earlier attempt of this case: units, start-limit counters, checkpoints."""
    unit = f"nanochat-train@{run}.service"
    for n in c.nodes:
        c.sh(n, f"systemctl stop {unit}; systemctl reset-failed {unit}; rm -rf /var/lib/nanochat/runs/{run} "
                f"/etc/nanochat/{run}.env", check=False)


def event_kill(c: Cluster, unit: str, node: str, at_least: int, since: float) -> dict:
    wait_mid_interval(c, unit, at_least)
    t0 = kill_trainer(c, node, unit)
    m = resume_after(c, unit, t0, node, timeout=300)
    check_resume(c, unit, t0, m, node, since)
    return m


def event_stop_container(c: Cluster, unit: str, node: str, at_least: int, away_s: float, since: float) -> dict:
    wait_mid_interval(c, unit, at_least)
    t0 = time.time()
    subprocess.run(["podman", "stop", c.ct(node)], check=True, capture_output=True, timeout=120)
    stopped_s = time.time() - t0
    log(f"podman stop {c.ct(node)} took {stopped_s:.1f}s")
    time.sleep(max(0.0, away_s - 10 - (time.time() - t0)))
    # while it is away the survivors have restarted and wait for it in torchrun's rendezvous
    away = {n: c.unit(n, unit) for n in c.nodes if n != node}
    time.sleep(max(0.0, away_s - (time.time() - t0)))
    subprocess.run(["podman", "start", c.ct(node)], check=True, capture_output=True, timeout=120)
    t_back = time.time()
    c.sh(node, "timeout 120 systemctl is-system-running --wait", check=False)
    autostart = wait_active(c, node, unit, 20)
    extra = {"container_stop_s": round(stopped_s, 1), "back_after_s": round(t_back - t0, 1),
             "unit_file_state": c.unit(node, unit).get("UnitFileState"), "autostart": autostart,
             "survivors_while_away": {n: f"{u['ActiveState']}/{u['SubState']}" for n, u in away.items()}}
    for n, u in away.items():
        expect(u["ActiveState"] in ("active", "activating"), f"{n} gave up while {node} was away: {u}")
    # run_start enabled the run's instance: the node rejoins at boot, nobody starts it by hand
    expect(autostart, f"{node}'s {unit} did not start when the node came back "
           f"(UnitFileState={extra['unit_file_state']}): the unit must be enabled for the run")
    m = resume_after(c, unit, t0, node, timeout=420)
    m.update(extra)
    check_resume(c, unit, t0, m, node, since)
    return m


EVENTS = ("kill-worker", "stop-worker", "kill-master")


def case_node_loss(c: Cluster, report: dict, events: list[str]) -> None:
    run = "faults-loss"
    unit = f"nanochat-train@{run}.service"
    iters = 150  # ~0.3 s a step: still running after the refused train.yml and three faults
    run_vars = {**RUN_VARS, "run_name": run, "num_iterations": iters}
    clean_run(c, run)
    t_start = time.time()
    rc, out, took = c.playbook("train.yml", run_vars)
    expect(rc == 0, f"train.yml failed:\n{show_train_failure(out)}")
    log(f"train.yml started {run} in {took:.0f}s")
    res = report.setdefault("node-loss", {})
    res["train_yml_s"] = round(took, 1)
    res["train_yml_slowest_tasks"] = slowest_tasks(out)
    wait_step(c, unit, 3, timeout=300)
    lines = steps(c.journal(c.master, unit, t_start))
    res["train_yml_to_step1_s"] = round(lines[0][0] - t_start, 1)
    res["step_s"] = round((lines[-1][0] - lines[0][0]) / max(1, lines[-1][1] - lines[0][1]), 2)

    # --- 6: train.yml again while the run is active: refused, the run untouched
    before = {n: (c.unit(n, unit)["InvocationID"], c.trainers(n)) for n in c.nodes}
    rc, out, took = c.playbook("train.yml", run_vars)
    expect(rc != 0, "a second train.yml during the run was not refused")
    expect("A training run is active on" in out and "restart=true" in out,
           f"the refusal does not name the run and the way out:\n{show_train_failure(out)}")
    after = {n: (c.unit(n, unit)["InvocationID"], c.trainers(n)) for n in c.nodes}
    expect(after == before, f"the refused train.yml changed the running units: {before} -> {after}")
    expect(all(len(p) == 1 for _, p in after.values()), f"not exactly one trainer per node: {after}")
    res["rerun_refused"] = {"seconds": round(took, 1),
                            "message": next((ln.strip() for ln in out.splitlines() if "A training run is active" in ln),
                                            "")[:400]}
    log(f"second train.yml refused in {took:.0f}s; units untouched")

    # --- 1-3: the faults, each once the run has passed another checkpoint
    at_least, t_last = CHECKPOINT_EVERY, t_start
    for event in events:
        t_last = time.time()
        if event == "kill-worker":
            m = event_kill(c, unit, c.workers[0], at_least, t_start)
        elif event == "kill-master":
            m = event_kill(c, unit, c.master, at_least, t_start)
        else:
            m = event_stop_container(c, unit, c.workers[0], at_least, 60, t_start)
        res[event] = m
        at_least = m["resumed_from"] + CHECKPOINT_EVERY
        log(f"{event}: " + json.dumps({k: v for k, v in m.items() if k not in c.nodes}))
        expect(at_least < iters - CHECKPOINT_EVERY, f"the run is too short for the next fault ({iters} steps)")

    # --- the run finishes: every node done, units ended cleanly, the final checkpoint complete
    def finished():
        return all(first(c.journal(n, unit, t_last), rf"done: {iters} steps") for n in c.nodes) and all(
            c.unit(n, unit)["ActiveState"] in ("inactive", "failed") for n in c.nodes)
    wait_for(f"every node to finish step {iters}", finished, timeout=600, every=3)
    for n in c.nodes:
        u = c.unit(n, unit)
        expect(u["ActiveState"] == "inactive" and u["Result"] == "success", f"{n}: {unit} ended {u}")
        # a finished run disables itself: it must not start alone at the next boot
        expect(u["UnitFileState"] == "disabled", f"{n}: {unit} is still {u['UnitFileState']} after the run finished")
        ck = c.sh(n, f"cat /var/lib/nanochat/runs/{run}/checkpoints/step_{iters:06d}/COMPLETE", check=False)
        expect(f'"step": {iters}' in ck, f"{n}: no complete checkpoint for step {iters}")
        starts = len([1 for _, msg in c.journal(n, unit, t_start) if msg.startswith("Started nanochat-train")])
        expect(starts <= 5, f"{n}: {starts} starts, StartLimitBurst is 5")
        res.setdefault("final", {})[f"{n}_starts"] = starts
    losses = steps(c.journal(c.master, unit, t_start))
    res["final"].update(final_step=losses[-1][1], final_loss=losses[-1][2], initial_loss=losses[0][2],
                        wall_s=round(losses[-1][0] - t_start, 1))
    log(f"run finished: {json.dumps(res['final'])}")


def slowest_tasks(out: str, n: int = 6) -> list[str]:
    """profile_tasks' summary lines ('role : task ---- 12.34s'), slowest first."""
    found = re.findall(r"^(\S.*?) -{2,} ([0-9.]+)s$", out, flags=re.MULTILINE)
    return [f"{name.strip()} {float(sec):.0f}s" for name, sec in found[:n]]


def wait_active(c: Cluster, node: str, unit: str, timeout: float) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if c.unit(node, unit).get("ActiveState") in ("active", "activating"):
            return True
        time.sleep(1)
    return False


# ---- data drift ------------------------------------------------------------------------------

def case_drift(c: Cluster, report: dict) -> None:
    run = "faults-drift"
    unit = f"nanochat-train@{run}.service"
    node, gone_node = c.workers[-1], c.workers[0]
    data = "/var/lib/nanochat/data/fortunes"
    shard, gone = f"{data}/shard_00001.parquet", f"{data}/shard_00003.parquet"
    res = report.setdefault("drift", {})
    # one node's shard changed, another's missing: what a partial re-push or a stray edit leaves
    c.sh(node, f"cp -p {shard} /root/shard.orig && printf drift >> {shard}")
    c.sh(gone_node, f"mv {gone} /root/shard.gone")
    try:
        run_vars = {**RUN_VARS, "run_name": run, "num_iterations": 10}
        rc, out, took = c.playbook("train.yml", run_vars)
        expect(rc != 0, "train.yml started a run on drifted data")
        msg = next((ln.strip() for ln in out.splitlines() if f"data verify FAILED on {node}" in ln), "")
        msg_gone = next((ln.strip() for ln in out.splitlines() if f"data verify FAILED on {gone_node}" in ln), "")
        expect(f"data verify FAILED on {node}: shard_00001.parquet" in msg and "site.yml" in msg,
               f"the preflight did not name {node} and the file:\n{show_train_failure(out)}")
        expect(f"data verify FAILED on {gone_node}: shard_00003.parquet" in msg_gone and "no file" in msg_gone,
               f"the preflight did not name {gone_node} and the missing file:\n{show_train_failure(out)}")
        for n in c.nodes:
            u = c.unit(n, unit)
            expect(u.get("InvocationID", "") == "" and u.get("ActiveState") == "inactive",
                   f"{n}: {unit} was started despite the failed preflight: {u}")
        res["preflight"] = {"seconds": round(took, 1), "message": msg[:400], "message_missing": msg_gone[:400]}
        log(f"preflight stopped train.yml in {took:.0f}s: {msg[:200]}")

        # started by hand anyway, with an env file like train.yml renders
        src = next(iter(c.sh(c.master, "ls /etc/nanochat/*.env").split()), "")
        expect(src != "", "no env file to copy (run the node-loss case first)")
        old = Path(src).stem
        for n in c.nodes:
            c.sh(n, f"sed 's/{old}/{run}/g' /etc/nanochat/{old}.env > /etc/nanochat/{run}.env && "
                    f"chgrp nanochat /etc/nanochat/{run}.env && chmod 0640 /etc/nanochat/{run}.env")
        t0 = time.time()
        start_everywhere(c, f"systemctl start {unit}")

        def all_fatal():
            got = {n: first(c.journal(n, unit, t0), r"FATAL") for n in c.nodes}
            return got if all(got.values()) else None
        fatal = wait_for("every rank's fingerprint message", all_fatal, timeout=240)
        # exit 3 (ranks disagree) is in RestartPreventExitStatus: each unit fails once, no restart loop
        ended = wait_all_failed(c, unit, "every unit to fail without a restart", timeout=60)
        for n, u in ended.items():
            expect(u["NRestarts"] == "0" and u["ExecMainStatus"] == "3", f"{n}: expected exit 3 and no restart: {u}")
        for n in c.nodes:
            c.sh(n, f"systemctl stop {unit}; systemctl reset-failed {unit} || true")
        res["by_hand"] = {}
        for n, (t, m) in fatal.items():
            expect("run fingerprint mismatch" in m and "file data/shard_00001.parquet" in m and f"{node} has" in m
                   and "file data/shard_00003.parquet" in m and f"{gone_node} has missing" in m,
                   f"{n}: not the fingerprint message naming both files: {m}")
            j = c.journal(n, unit, t0)
            banner = first(j, r"\] nanochat_cpu ")
            res["by_hand"][n] = {"fatal_s": round(t - t0, 1),
                                 "after_banner_s": round(t - banner[0], 1) if banner else None}
            expect(banner is None or t - banner[0] < 30, f"{n}: {t - banner[0]:.0f}s from start to the message")
        res["by_hand"]["message"] = fatal[c.master][1][:500]
        log(f"units started by hand: {json.dumps(res['by_hand'])}")
    finally:
        c.sh(node, f"cp -p /root/shard.orig {shard}", check=False)
        c.sh(gone_node, f"mv /root/shard.gone {gone}", check=False)
        for n in c.nodes:
            c.sh(n, f"systemctl stop {unit}; systemctl reset-failed {unit}; rm -f /etc/nanochat/{run}.env", check=False)



def wait_all_failed(c: Cluster, unit: str, what: str, timeout: float) -> dict[str, dict[str, str]]:
    """Each node's unit state, once the unit is `failed` on every node."""
    def probe():
        got = {n: c.unit(n, unit) for n in c.nodes}
        return got if all(u["ActiveState"] == "failed" for u in got.values()) else None
    return wait_for(what, probe, timeout)

def start_everywhere(c: Cluster, cmd: str) -> None:
    """Run `cmd` on every node at once (units of one run must start together)."""
    threads = [threading.Thread(target=c.sh, args=(n, cmd)) for n in c.nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


# ---- network misconfiguration ----------------------------------------------------------------

def case_network(c: Cluster, report: dict, workdir: Path) -> None:
    run = "faults-net"
    unit = f"nanochat-train@{run}.service"
    run_vars = {**RUN_VARS, "run_name": run, "num_iterations": 10}
    res = report.setdefault("network", {})
    wrong_if, v6_node = c.workers[0], c.workers[-1]
    # an interface with only an IPv6 address (one end of a veth pair), chosen as train_interface
    c.sh(v6_node, "ip link add v6only type veth peer name v6peer && ip -6 addr add fd77::12/64 dev v6only "
                  "nodad && ip link set v6only up && ip link set v6peer up")
    override = workdir / "faults-wrong-interfaces.yml"
    override.write_text(yaml.safe_dump({"all": {"hosts": {wrong_if: {"train_interface": "eth7"},
                                                          v6_node: {"train_interface": "v6only"}}}}))
    try:
        rc, out, took = c.playbook("train.yml", run_vars, extra_inventory=override)
        expect(rc != 0, "train.yml started with wrong interfaces")
        msgs = {
            "wrong_interface": f"{wrong_if}: train_interface 'eth7' does not exist",
            "ipv6_only": f"{v6_node}: train_interface 'v6only' has no IPv4 address in lan_subnet",
        }
        for key, want in msgs.items():
            line = next((ln.strip() for ln in out.splitlines() if want in ln), "")
            expect(line != "", f"the preflight did not say {want!r}:\n{show_train_failure(out)}")
            expect("Fix:" in line, f"no fix in: {line}")
            res[key] = {"seconds": round(took, 1), "message": line[:400]}
        log(f"wrong interfaces stopped in {took:.0f}s")
    finally:
        c.sh(v6_node, "ip link del v6only", check=False)
        override.unlink(missing_ok=True)
    for n in c.nodes:
        expect(c.unit(n, unit).get("InvocationID", "") == "", f"{n}: {unit} started despite the preflight")

    # ufw on a worker drops the Gloo range
    node = c.workers[-1]
    gmin, gmax = 40000, 40999
    rule = f"proto tcp from {c.subnet} to any port {gmin}:{gmax}"
    c.sh(node, f"ufw delete allow {rule}")
    try:
        rc, out, took = c.playbook("train.yml", run_vars)
        expect(rc != 0, "train.yml started with the Gloo range blocked")
        line = next((ln.strip() for ln in out.splitlines() if f"cannot reach {node}" in ln and "Gloo range" in ln), "")
        expect(line != "" and f"Check ufw on {node}" in line,
               f"the preflight did not name {node}'s blocked Gloo port:\n{show_train_failure(out)}")
        res["ufw_gloo_blocked"] = {"seconds": round(took, 1), "message": line[:400]}
        log(f"blocked Gloo range stopped in {took:.0f}s: {line[:200]}")
    finally:
        c.sh(node, f"ufw allow {rule} comment 'nanochat gloo'", check=False)
    for n in c.nodes:
        expect(c.unit(n, unit).get("InvocationID", "") == "", f"{n}: {unit} started despite the preflight")


# ---- stale processes and ports ---------------------------------------------------------------

def case_stale(c: Cluster, report: dict) -> None:
    run = "faults-stale"
    unit = f"nanochat-train@{run}.service"
    run_vars = {**RUN_VARS, "run_name": run, "num_iterations": 10}
    res = report.setdefault("stale", {})
    port = c.master_port
    # a foreign server on the rendezvous port of the master
    c.sh(c.master, f"systemd-run --unit faults-squatter /usr/bin/python3 -m http.server {port}")
    try:
        pid = wait_for("the squatter to listen", lambda: c.sh(c.master, f"ss -H -ltnp 'sport = :{port}'").strip()
                       and c.unit(c.master, "faults-squatter.service")["MainPID"], timeout=30, every=0.5)
        r = refused(c, run_vars, f"{c.master}: port {port} (master_port) is held by PID {pid} (python3)",
                    "a foreign process on the master port")
        expect(f"kill {pid}" in r["message"], f"no fix in: {r['message']}")
        res["master_port_held"] = r
    finally:
        c.sh(c.master, "systemctl stop faults-squatter.service", check=False)
    expect_no_unit(c, unit)

    # a launcher left over from a run started by hand, waiting in its rendezvous on a worker
    node = c.workers[0]
    c.sh(node, "systemd-run --unit faults-orphan /opt/nanochat/venv/bin/python -m nanochat_cpu.launch --nnodes 2 "
               "--node-rank 1 --nproc-per-node 1 --master-addr 127.0.0.1 --master-port 29411 "
               "-m nanochat_cpu.train --depth 2")
    try:
        pid = wait_for("the orphan to run", lambda: c.unit(node, "faults-orphan.service")["MainPID"] != "0"
                       and c.unit(node, "faults-orphan.service")["MainPID"], timeout=30, every=0.5)
        r = refused(c, run_vars, f"{node}: trainer process {pid} runs outside any nanochat-train@ unit",
                    "an orphan trainer")
        expect(f"kill {pid}" in r["message"], f"no fix in: {r['message']}")
        res["orphan_trainer"] = r
    finally:
        c.sh(node, "systemctl stop faults-orphan.service", check=False)
    expect_no_unit(c, unit)


def expect_no_unit(c: Cluster, unit: str) -> None:
    for n in c.nodes:
        u = c.unit(n, unit)
        expect(u.get("InvocationID", "") == "" and u.get("ActiveState") == "inactive",
               f"{n}: {unit} was started despite the failed preflight: {u}")


# ---- disk full and a checkpoint write cut short -----------------------------------------------

def complete_steps(c: Cluster, node: str, run: str) -> list[int]:
    out = c.sh(node, f"ls /var/lib/nanochat/runs/{run}/checkpoints/*/COMPLETE 2>/dev/null || true")
    return sorted(int(m) for m in re.findall(r"step_(\d+)/COMPLETE", out))


def case_checkpoint(c: Cluster, report: dict) -> None:
    run = "faults-disk"
    unit = f"nanochat-train@{run}.service"
    node = c.workers[-1]
    rundir = f"/var/lib/nanochat/runs/{run}"
    iters = 60
    run_vars = {**RUN_VARS, "run_name": run, "num_iterations": iters}
    res = report.setdefault("checkpoint", {})
    c.sh(node, f"umount {rundir}", check=False)
    clean_run(c, run)
    # the node's run directory on a small filesystem of its own, so it can fill up
    c.sh(node, f"mkdir -p {rundir} && mount -t tmpfs -o size=128m,mode=0755 faults-disk {rundir} && "
               f"chown nanochat:nanochat {rundir}")
    try:
        t_start = time.time()
        rc, out, took = c.playbook("train.yml", run_vars)
        expect(rc == 0, f"train.yml failed:\n{show_train_failure(out)}")
        # --- disk full: once step 10's checkpoint is sealed, fill the node's disk
        wait_for("step 10's checkpoint", lambda: 10 in complete_steps(c, node, run), timeout=300, every=0.2)
        c.sh(node, f"dd if=/dev/zero of={rundir}/filler bs=1M 2>/dev/null || true")
        t0 = time.time()
        log(f"{node}: {rundir} filled")

        ended = wait_all_failed(c, unit, "every unit to stop on the full disk", timeout=COLLECTIVE_TIMEOUT + 60)
        full = {}
        for n, u in ended.items():
            # exit 2 is in RestartPreventExitStatus: a full disk needs a person, not a restart loop
            expect(u["ExecMainStatus"] == "2" and u["NRestarts"] == "0", f"{n}: expected exit 2, no restart: {u}")
            hit = first(c.journal(n, unit, t0), r"FATAL: .*cannot write checkpoint step 20")
            expect(hit is not None and f"@{node}: cannot write checkpoint step 20" in hit[1]
                   and "No space left on device" in hit[1] and "newest complete: 10" in hit[1],
                   f"{n}: no FATAL line naming {node}'s full disk: {hit}")
            expect(complete_steps(c, n, run)[-1:] == [10], f"{n}: newest complete checkpoint is not step 10: "
                   f"{complete_steps(c, n, run)}")
            full[n] = round(hit[0] - t0, 1)
        left = c.sh(node, f"ls -A {rundir}/checkpoints/step_000020 2>/dev/null || true").split()
        expect(not [f for f in left if ".tmp." in f], f"{node}: the failed write left its partial file: {left}")
        res["disk_full"] = {"fatal_s": full, "message": hit[1][:500], "left_in_step_20": left}
        log(f"disk full: every rank stopped with exit 2 naming {node}: {full}")

        # --- the operator frees space and starts the units again (train.yml would do the same,
        # after a minute of preflight): the run resumes from step 10
        c.sh(node, f"rm -f {rundir}/filler")
        t_again = time.time()
        start_everywhere(c, f"systemctl reset-failed {unit}; systemctl start {unit}")
        lines = wait_for("the run to resume", lambda: (j := c.journal(c.master, unit, t_again))
                         and first(j, r"resumed from checkpoint step 10") and steps(j) and j, timeout=300, every=2)
        res["disk_full"]["resumed_s_after_start"] = round(first(lines, r"resumed from")[0] - t_again, 1)
        before = {s: loss for _, s, loss in steps(c.journal(c.master, unit, t_start), before=t_again)}
        # --- SIGKILL of the node's trainer while it writes its next checkpoint: a watcher on the
        # node polls for the temporary file of a checkpoint write (it exists ~50 ms of each 0.1-s save)
        pid = c.unit(node, unit)["MainPID"]
        trainer = c.sh(node, f"pgrep -P {pid} -f nanochat_cpu.train").split()[0]
        watcher = (f"import glob, os, time\nend = time.time() + 120\n"
                   f"while time.time() < end:\n"
                   f"    hits = glob.glob('{rundir}/checkpoints/step_*/*.tmp.*')\n"
                   f"    if hits:\n        os.kill({trainer}, 9)\n        print(' '.join(hits))\n        break\n")
        killed = c.sh(node, f"python3 -c \"{watcher}\"", timeout=150).strip()
        t0 = time.time()
        expect(killed != "", f"{node}: never saw a checkpoint being written")
        killed_step = int(re.search(r"step_(\d+)/", killed).group(1))
        left = c.sh(node, f"ls -A {rundir}/checkpoints/step_{killed_step:06d}").split()
        log(f"SIGKILL {node} trainer {trainer} while writing {killed}; left {left}")
        expect("COMPLETE" not in left, f"{node}: step {killed_step} sealed despite the kill: {left}")
        m = resume_after(c, unit, t0, node, timeout=300)
        check_resume(c, unit, t0, m, node, t_start)
        expect(m["resumed_from"] == killed_step - CHECKPOINT_EVERY,
               f"resumed from {m['resumed_from']}, expected the last complete step {killed_step - CHECKPOINT_EVERY}")
        res["sigkill_mid_write"] = {"writing": killed, "left": left,
                                    **{k: v for k, v in m.items() if k not in c.nodes}}
        # the steps redone after the disk-full stop matched the first attempt's
        after = {s: loss for _, s, loss in steps(c.journal(c.master, unit, t_again))}
        redone = [s for s in range(11, 21) if s in before and s in after]
        diff = max((abs(before[s] - after[s]) for s in redone), default=math.inf)
        expect(diff < 1e-2, f"the steps redone after the disk-full stop differ: {before} vs {after}")
        res["disk_full"]["max_loss_diff_redone"] = diff

        def finished():
            return all(c.unit(n, unit)["ActiveState"] == "inactive" and
                       first(c.journal(n, unit, t0), rf"done: {iters} steps") for n in c.nodes)
        wait_for(f"the run to finish step {iters}", finished, timeout=400, every=3)
        for n in c.nodes:
            expect(iters in complete_steps(c, n, run), f"{n}: no complete checkpoint for step {iters}")
        log(f"checkpoint case: {json.dumps(res)[:600]}")
    finally:
        c.sh(node, f"systemctl stop {unit}; umount {rundir}", check=False)
        clean_run(c, run)


# ---- bad inputs --------------------------------------------------------------------------------

def node_state(c: Cluster) -> dict[str, str]:
    """What train.yml would change on a node: env files, run directories, trainer units."""
    return {n: c.sh(n, "ls -la --time-style=+%s /etc/nanochat /var/lib/nanochat/runs; "
                       "systemctl list-units 'nanochat-train@*' --all --no-legend --plain", check=False)
            for n in c.nodes}


def refused(c: Cluster, run_vars: dict, want: str, what: str) -> dict:
    rc, out, took = c.playbook("train.yml", run_vars)
    expect(rc != 0, f"train.yml accepted {what}")
    # Ansible folds long messages over lines: search the output with its whitespace collapsed
    flat = " ".join(out.split())
    at = flat.find(want)
    expect(at >= 0, f"train.yml did not say {want!r} for {what}:\n{show_train_failure(out)}")
    start = max(flat.rfind("msg:", 0, at), flat.rfind("Action failed:", 0, at), at - 200)
    log(f"{what}: refused in {took:.0f}s")
    return {"seconds": round(took, 1), "message": flat[start:at + 400]}


def case_inputs(c: Cluster, report: dict, workdir: Path) -> None:
    res = report.setdefault("inputs", {})
    done = [r for r in c.sh(c.master, "ls /var/lib/nanochat/runs/*/checkpoints/*/COMPLETE 2>/dev/null || true")
            .split() if "faults-loss" in r]
    expect(done != [], "no finished run to resume (run the node-loss case first)")
    run_vars = {**RUN_VARS, "run_name": "faults-inputs", "num_iterations": 10}
    state = node_state(c)
    # extra-vars: refused on the controller, before any node is contacted
    for over, want in ((("depth", "eight"), "depth=eight must be a positive integer"),
                       (("dtype", "fp16"), "dtype=fp16 must be one of: auto, float32, bfloat16"),
                       (("total_batch_size", 1000), "total_batch_size=1000 must be auto or a positive multiple")):
        res[f"extra_var_{over[0]}"] = refused(c, {**run_vars, over[0]: over[1]}, want, f"-e {over[0]}={over[1]}")
    # a trainer flag: refused by every node's preflight with the trainer's own parser
    res["trainer_flag"] = refused(c, {**run_vars, "train_extra_args": "--matrix-lr fast"},
                                  "the trainer rejects its flags: argument --matrix-lr: invalid float value: 'fast'",
                                  "train_extra_args=--matrix-lr fast")
    # a missing data dir on one node
    node = c.workers[0]
    data = "/var/lib/nanochat/data/fortunes"
    c.sh(node, f"mv {data} /root/data.away")
    try:
        res["missing_data_dir"] = refused(c, run_vars, f"{node}: manifest.json missing", f"no {data} on {node}")
    finally:
        c.sh(node, f"mv /root/data.away {data}", check=False)
    # an empty shard and a corrupt one, pushed consistently (the manifest describes them): the
    # hashes agree, the trainer's own check of every shard refuses them
    for n in c.nodes:
        c.sh(n, f"mkdir -p /root/data.orig && cp -p {data}/manifest.json {data}/shard_00001.parquet "
                f"{data}/shard_00002.parquet /root/data.orig/ && /opt/nanochat/venv/bin/python -c \"{BAD_SHARDS}\" "
                f"{data}")
    try:
        r = refused(c, run_vars, "shard_00001.parquet: empty shard (0 rows)", "an empty and a corrupt shard")
        expect("shard_00002.parquet: not a readable parquet file" in r["message"], f"corrupt shard not named: {r}")
        res["bad_shards"] = r
    finally:
        for n in c.nodes:
            c.sh(n, f"cp -p /root/data.orig/* {data}/ && rm -rf /root/data.orig", check=False)
    # resuming the finished node-loss run with a tokenizer from another corpus
    tok = "/var/lib/nanochat/tokenizer/fortunes/tokenizer.json"
    c.sh(c.master, "cd /root && /opt/nanochat/venv/bin/python -m nanochat_cpu.data prepare --source "
                   "/usr/share/common-licenses --out other-data --rows-per-group 16 >/dev/null && "
                   "/opt/nanochat/venv/bin/python -m nanochat_cpu.tokenizer train --data-dir other-data "
                   "--vocab-size 512 --out other-tok >/dev/null")
    foreign = workdir / "faults-foreign-tokenizer.json"
    subprocess.run(["podman", "cp", f"{c.ct(c.master)}:/root/other-tok/tokenizer.json", str(foreign)], check=True)
    for n in c.nodes:
        c.sh(n, f"cp -p {tok} /root/tokenizer.orig")
        subprocess.run(["podman", "cp", str(foreign), f"{c.ct(n)}:{tok}"], check=True)
    resume_vars = {**RUN_VARS, "run_name": "faults-loss", "num_iterations": 160}
    try:
        res["foreign_tokenizer"] = refused(c, resume_vars, "was trained with another tokenizer",
                                           "resuming faults-loss with a foreign tokenizer")
    finally:
        for n in c.nodes:
            c.sh(n, f"cp -p /root/tokenizer.orig {tok} && rm -rf /root/tokenizer.orig /root/other-*", check=False)
        foreign.unlink(missing_ok=True)
    after = node_state(c)
    expect(after == state, f"a refused train.yml changed a node: {state} -> {after}")


# an empty shard 1 and garbage in shard 2, with manifest entries that describe them
BAD_SHARDS = ("import hashlib, json, sys, pathlib, pyarrow as pa, pyarrow.parquet as pq; "
              "d = pathlib.Path(sys.argv[1]); "
              "pq.write_table(pa.table({'text': pa.array([], pa.string())}), d / 'shard_00001.parquet'); "
              "(d / 'shard_00002.parquet').write_bytes(b'not a parquet file ' * 200); "
              "m = json.loads((d / 'manifest.json').read_text()); "
              "[e.update(bytes=len(b), sha256=hashlib.sha256(b).hexdigest(), rows=0) for e in m['files'] "
              "if e['file'] in ('shard_00001.parquet', 'shard_00002.parquet') "
              "for b in [(d / e['file']).read_bytes()]]; "
              "(d / 'manifest.json').write_text(json.dumps(m, indent=1))")


# ---- main ------------------------------------------------------------------------------------

CASES = {"node-loss": case_node_loss, "drift": case_drift, "network": case_network, "stale": case_stale,
         "checkpoint": case_checkpoint, "inputs": case_inputs}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--inventory", type=Path, required=True)
    p.add_argument("--report", type=Path, required=True, help="JSON file the measurements are merged into")
    p.add_argument("--events", default=",".join(EVENTS),
                   help=f"node-loss faults, in order, comma-separated (default: all of {', '.join(EVENTS)})")
    p.add_argument("cases", nargs="+", choices=sorted(CASES))
    args = p.parse_args()
    events = [e for e in args.events.split(",") if e]
    bad = set(events) - set(EVENTS)
    if bad:
        p.error(f"unknown --events {sorted(bad)}; choose from {', '.join(EVENTS)}")
    c = Cluster(args.inventory)
    report = json.loads(args.report.read_text()) if args.report.exists() else {}
    status = 0
    for name in args.cases:
        t0 = time.time()
        report[name] = {}  # this attempt's results only
        log(f"case {name}")
        try:
            if name in ("network", "inputs"):
                CASES[name](c, report, args.report.parent)
            elif name == "node-loss":
                case_node_loss(c, report, events)
            else:
                CASES[name](c, report)
            report.setdefault(name, {})["case_s"] = round(time.time() - t0, 1)
            log(f"case {name} passed in {time.time() - t0:.0f}s")
        except Failed as exc:
            report.setdefault(name, {})["failed"] = str(exc)[:2000]
            log(f"case {name} FAILED: {exc}")
            status = 1
        finally:
            args.report.parent.mkdir(parents=True, exist_ok=True)
            args.report.write_text(json.dumps(report, indent=1) + "\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
