"""The cases' tiny training runs: start, progress, resume after a fault, and a train.yml refused.

A run resumed after a fault must have gone back to its last complete checkpoint (steps lost <= the
checkpoint interval) and its redone steps must repeat the losses computed before the fault: the curve
goes on, no reset to ln(vocab).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

from nodes import STEP, Cluster, first, log, show_train_failure, steps, wait_for

VOCAB = 4096  # the demo tokenizer (the dataset role): a fresh model's loss is ln(4096) = 8.32
# A tiny run: every fault case fits the CI budget on 2 cores.
CHECKPOINT_EVERY = 10
COLLECTIVE_TIMEOUT = 60
# Every step synchronous: the cases count on a checkpoint every CHECKPOINT_EVERY steps, where
# train.yml's default (sync_every=auto) may choose local steps, whose checkpoints wait for outer
# boundaries; faults under local steps are tests/test_local_steps.py's (a node lost mid inner
# phase, resume mid phase and at a boundary).
RUN_VARS = {
    "depth": 2, "max_seq_len": 64, "device_batch_size": 2, "eval_every": 0, "eval_tokens": 384,
    "sample_every": 0, "checkpoint_every": CHECKPOINT_EVERY, "sync_every": 1,
    "train_extra_args": f"--collective-timeout {COLLECTIVE_TIMEOUT}",
}

# the demo dataset on every node, and a shard the cases drift
DATA = "/var/lib/nanochat/data/fortunes"
SHARD = f"{DATA}/shard_00001.parquet"


@dataclass
class Run:
    """One case's run: train.yml's extra-vars for it and its systemd unit on every node."""
    name: str
    iterations: int
    started: float = 0.0  # when its train.yml began: its journal lines are the ones after

    @property
    def unit(self) -> str:
        return f"nanochat-train@{self.name}.service"

    @property
    def dir(self) -> str:
        return f"/var/lib/nanochat/runs/{self.name}"

    @property
    def vars(self) -> dict:
        return {**RUN_VARS, "run_name": self.name, "num_iterations": self.iterations}


def clean_run(c: Cluster, run: Run) -> None:
    """Forget an earlier attempt of this case: units, start-limit counters, checkpoints."""
    for n in c.nodes:
        c.sh(n, f"systemctl stop {run.unit}; systemctl reset-failed {run.unit}; rm -rf {run.dir} "
                f"/etc/nanochat/{run.name}.env", check=False)


def run_state(c: Cluster, run: Run) -> str:
    """Every node's unit state, checkpoint directories and last journal lines of this run (their
    times to the microsecond: what a wait missed before its start shows too): what a failed wait
    shows, so that a case that failed once says why."""
    cmd = (f"systemctl is-active {run.unit}; ls {run.dir}/checkpoints 2>&1 | tail -n 5; df -h {run.dir} | tail -n 1; "
           f"journalctl -u {run.unit} -o short-precise --no-pager --since @{run.started:.6f} | tail -n 25")
    return "\n".join(f"---- {n}:\n{c.sh(n, cmd, check=False)}" for n in c.nodes)


def complete_steps(c: Cluster, node: str, run: Run) -> list[int]:
    out = c.sh(node, f"ls {run.dir}/checkpoints/*/COMPLETE 2>/dev/null || true")
    return sorted(int(m) for m in re.findall(r"step_(\d+)/COMPLETE", out))


# ---- progress ----------------------------------------------------------------------------------

def last_step(c: Cluster, unit: str, since: float) -> int:
    """The master's newest step line since `since` (a journal outlives a rerun of the same run)."""
    # (-n with --since would give the first lines after it, not the newest)
    out = c.sh(c.master, f"journalctl -u {unit} -o cat --no-pager --since @{since:.6f} | tail -n 20", check=False)
    found = [int(m.group(1)) for m in STEP.finditer(out)]
    return found[-1] if found else 0



def wait_step(c: Cluster, unit: str, at_least: int, since: float, timeout: float) -> int:
    return wait_for(f"step {at_least}", lambda: (s := last_step(c, unit, since)) >= at_least and s, timeout, every=1)


def wait_mid_interval(c: Cluster, unit: str, at_least: int, since: float, timeout: float = 300) -> int:
    """A step >= at_least half way between two checkpoints: a fault there loses work."""
    def probe():
        s = last_step(c, unit, since)
        return s if s >= at_least and 3 <= s % CHECKPOINT_EVERY <= CHECKPOINT_EVERY - 3 else None
    return wait_for(f"a step >= {at_least} between checkpoints", probe, timeout, every=0.2)


def wait_all_failed(c: Cluster, unit: str, what: str, timeout: float,
                    state: Callable[[], str] | None = None) -> dict[str, dict[str, str]]:
    """Each node's unit state, once the unit is `failed` on every node."""
    def probe():
        got = {n: c.unit(n, unit) for n in c.nodes}
        return got if all(u["ActiveState"] == "failed" for u in got.values()) else None
    return wait_for(what, probe, timeout, state=state)


def wait_active(c: Cluster, node: str, unit: str, timeout: float) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if c.unit(node, unit).get("ActiveState") in ("active", "activating"):
            return True
        time.sleep(1)
    return False


# ---- a fault and the resume after it -----------------------------------------------------------

def trainer_pid(c: Cluster, node: str, unit: str) -> str:
    pid = c.unit(node, unit)["MainPID"]
    workers = c.sh(node, f"pgrep -P {pid} -f nanochat_cpu.train").split()
    assert len(workers) == 1, f"{node}: expected one trainer under torchrun {pid}, found {workers}"
    return workers[0]


def kill_mid_interval(c: Cluster, node: str, unit: str, at_least: int, since: float) -> float:
    """SIGKILL of the node's trainer half way between two checkpoints (its pid looked up first: a
    step may take 0.1 s, a `podman exec` 0.3)."""
    pid = trainer_pid(c, node, unit)
    wait_mid_interval(c, unit, at_least, since)
    t0 = time.time()
    c.sh(node, f"kill -9 {pid}")
    log(f"SIGKILL {node} trainer pid {pid}")
    return t0


WORLD_STEP = re.compile(r"rank \d+/(\d+)\] step (\d+)/")  # a step line's world size and step
def world_steps(lines: list[tuple[float, str]], after: float) -> list[tuple[float, int, int]]:
    """(time, world size, step) of the master's step lines after `after`."""
    return [(t, int(hit.group(1)), int(hit.group(2))) for t, msg in lines
            if t >= after and (hit := WORLD_STEP.search(msg))]


# the resume line at the same layout ("resumed from checkpoint step N (...)") and at another
# ("resumed step N, written by 3 ranks ..., re-sharded to 2 ranks")
RESUMED = r"resumed (?:from checkpoint )?step \d+"
# nanochat_cpu.launch, when its workers exit and it re-forms the group
# (or, when torch's agent saw launchers waiting to join while its ranks were closing, its own restart)
WORKERS_EXITED = r"launcher: (?:the (?:ranks stopped at a checkpoint|workers exited)|nodes are waiting to join)"


def resume_after(c: Cluster, unit: str, t0: float, killed: str | None, timeout: float,
                 state: Callable[[], str] | None = None) -> dict:
    """Wait until the run trains again after a fault injected at t0; measure each phase. `state`
    says what a wait that never ended saw (run_state)."""
    survivors = [n for n in c.nodes if n != killed]
    # the survivors' workers exit (FATAL: a peer lost; or a clean stop at a checkpoint), and their
    # launchers re-form the group (launch.py's lines): the unit itself stays active
    wait_for("the survivors' workers to exit", lambda: all(
        first(c.journal(n, unit, t0), rf"FATAL|{WORKERS_EXITED}|Main process exited|Failed with result")
        for n in survivors), timeout=COLLECTIVE_TIMEOUT + 60, state=state)

    def resumed():
        lines = c.journal(c.master, unit, t0)
        hit = first(lines, RESUMED)
        if hit and steps(lines, after=hit[0]):
            return lines
        return None

    lines = wait_for("the run to resume and train a step", resumed, timeout=timeout, every=3, state=state)
    t_res, msg = first(lines, RESUMED)
    resumed_step = int(re.search(r"step (\d+)", msg).group(1))
    t_step, step1, loss1 = steps(lines, after=t_res)[0]
    m = {"resumed_from": resumed_step, "resume_s": round(t_res - t0, 1), "first_step_s": round(t_step - t0, 1),
         "first_loss_after": loss1}
    for n in c.nodes:
        j = c.journal(n, unit, t0)
        fatal = first(j, r"FATAL")
        exited = first(j, rf"{WORKERS_EXITED}|Main process exited|Failed with result|Deactivated|Stopped")
        started = first(j, r"Started nanochat-train")
        m[n] = {"fatal_s": round(fatal[0] - t0, 1) if fatal else None,
                "fatal": fatal[1][:300] if fatal else None,
                "exit_s": round(exited[0] - t0, 1) if exited else None,
                "restart_s": round(started[0] - t0, 1) if started else None,
                "restarts": int(c.unit(n, unit).get("NRestarts", "0") or 0)}
    return m


def check_resume(c: Cluster, unit: str, t0: float, m: dict, killed: str | None, since: float) -> None:
    lines = c.journal(c.master, unit, since)  # this run's lines only (a journal outlives a rerun)
    before = world_losses(lines, before=t0)
    last_before = max(before)
    m["last_step_before"] = last_before
    m["steps_lost"] = last_before - m["resumed_from"]
    # a node shut down cleanly (its systemd stops the unit) stops every rank after one more step,
    # with a checkpoint there: the run resumes at that step, losing none
    stop_line = rf"stopped by SIGTERM after step {m['resumed_from']} "
    m["graceful"] = first(c.journal(c.master, unit, t0), stop_line) is not None
    if m["graceful"]:
        assert m["steps_lost"] <= 0, f"stopped at step {m['resumed_from']}, but step {last_before} was seen before"
        m["steps_lost"] = 0
    else:
        assert m["resumed_from"] % CHECKPOINT_EVERY == 0, f"resumed from step {m['resumed_from']}, not a checkpoint"
    assert 0 <= m["steps_lost"] <= CHECKPOINT_EVERY, (
        f"lost {m['steps_lost']} steps (last step {last_before}, resumed from {m['resumed_from']}), "
        f"more than --checkpoint-every {CHECKPOINT_EVERY}")
    for n in c.nodes:
        if n == killed:
            continue
        fatal = m[n]["fatal_s"]
        assert fatal is not None or m[n]["exit_s"] is not None, f"{n} did not exit after the fault"
        bound = COLLECTIVE_TIMEOUT + 30
        assert (fatal or m[n]["exit_s"]) <= bound, (
            f"{n} took {fatal}s to give up (bound {bound}s: --collective-timeout {COLLECTIVE_TIMEOUT} + 30)")
    # the resumed run recomputes the lost steps: the same losses (same data, RNG, optimizer
    # state) prove it continued the curve from the checkpoint instead of starting over. The master
    # logs its own rows' loss, so only a step redone at the same world size can repeat its value.
    after = world_losses(lines, after=t0)
    redone = [s for s in range(m["resumed_from"] + 1, last_before + 1) if s in after and s in before]
    same = [s for s in redone if after[s][0] == before[s][0]]
    m["redone_at_another_world"] = len(redone) - len(same)
    m["max_loss_diff_redone"] = max((abs(after[s][1] - before[s][1]) for s in same), default=0.0)
    assert m["max_loss_diff_redone"] < 1e-2, (
        f"losses of the redone steps differ: {[(s, before[s], after[s]) for s in same]}")
    first_loss, initial = m["first_loss_after"], before[1][1]
    assert first_loss < math.log(VOCAB) - 0.3 and first_loss < initial - 0.3, (
        f"loss after resume {first_loss} is back near the initial {initial} (ln {VOCAB} = {math.log(VOCAB):.2f})")


def world_losses(lines: list[tuple[float, str]], after: float = 0.0, before: float = math.inf
                 ) -> dict[int, tuple[int, float]]:
    """step -> (world size, loss) of the master's step lines in [after, before)."""
    worlds = {int(hit.group(2)): int(hit.group(1)) for t, msg in lines
              if after <= t < before and (hit := WORLD_STEP.search(msg))}
    return {s: (worlds[s], loss) for _, s, loss in steps(lines, after, before)}


# ---- a train.yml the preflight refuses ---------------------------------------------------------

def refused(c: Cluster, run_vars: dict, want: str, what: str) -> dict:
    """train.yml with `run_vars` fails saying `want`: its time and the message around it."""
    rc, out, took = c.playbook("train.yml", run_vars)
    assert rc != 0, f"train.yml accepted {what}"
    # Ansible folds long messages over lines: search the output with its whitespace collapsed
    flat = " ".join(out.split())
    at = flat.find(want)
    assert at >= 0, f"train.yml did not say {want!r} for {what}:\n{show_train_failure(out)}"
    start = max(flat.rfind("msg:", 0, at), flat.rfind("Action failed:", 0, at), at - 200)
    log(f"{what}: refused in {took:.0f}s")
    return {"seconds": round(took, 1), "message": flat[start:at + 400]}


def assert_no_unit_started(c: Cluster, unit: str) -> None:
    for n in c.nodes:
        u = c.unit(n, unit)
        assert u.get("InvocationID", "") == "" and u.get("ActiveState") == "inactive", (
            f"{n}: {unit} was started despite the failed preflight: {u}")
