"""The converged cluster as the fault tests reach it: podman exec, systemd units, journals, playbooks.

Everything is read from the nodes' journals (timestamps are the host's clock: the containers share its
kernel) and their files. Standard library + PyYAML (the controller's Ansible venv) only.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import yaml

REPO = Path(__file__).resolve().parents[2]
# a worker's command line, as the launcher (torchrun's agent) starts it with its own interpreter
TRAINER = "python3? -u -m nanochat_cpu.train"
STEP = re.compile(r"\] step (\d+)/(\d+) (?:\([0-9.]+%\) )?loss=([0-9.]+|nan|inf)")

Journal = list[tuple[float, str]]
T = TypeVar("T")


def log(msg: str) -> None:
    """A timestamped progress line (pytest shows a test's lines with its result)."""
    print(f"[faults {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Cluster:
    """The nodes of a generated inventory (hosts.yml), reached through `podman exec`."""

    def __init__(self, inventory: Path):
        self.inventory = inventory
        tree = yaml.safe_load((inventory / "hosts.yml").read_text())
        groups = tree["all"]["children"]["cluster"]["children"]
        self.master = next(iter(groups["master"]["hosts"]))
        self.workers = list(groups["workers"]["hosts"])
        self.nodes = [self.master, *self.workers]
        self.hostvars = {**groups["master"]["hosts"], **groups["workers"]["hosts"]}
        self.subnet = tree["all"]["vars"]["lan_subnet"]
        self.name = tree["all"]["vars"]["local_cluster_name"]  # its containers, network and label
        self.master_port = int(tree["all"]["vars"].get("master_port", 29500))

    def ct(self, node: str) -> str:
        """The node's container."""
        return self.hostvars[node]["ansible_host"]

    def sh(self, node: str, cmd: str, check: bool = True, timeout: float = 120) -> str:
        proc = subprocess.run(["podman", "exec", self.ct(node), "bash", "-c", cmd], capture_output=True, text=True,
                              timeout=timeout)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{node}: `{cmd}` exited {proc.returncode}: {proc.stdout[-2000:]}{proc.stderr[-2000:]}")
        return proc.stdout

    def journal(self, node: str, unit: str, since: float = 0.0) -> Journal:
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
        """ansible-playbook NAME on this inventory: (exit code, output, seconds)."""
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


def start_everywhere(c: Cluster, cmd: str) -> None:
    """Run `cmd` on every node at once (units of one run must start together)."""
    threads = [threading.Thread(target=c.sh, args=(n, cmd)) for n in c.nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def podman(*args: str) -> None:
    subprocess.run(["podman", *args], check=True, capture_output=True, timeout=120)


def wait_for(what: str, probe: Callable[[], T], timeout: float, every: float = 2.0,
             state: Callable[[], str] | None = None) -> T:
    """probe()'s first truthy answer; an AssertionError naming `what` after `timeout` seconds, with
    what `state()` then says (the units and journals behind a wait that never ended)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        got = probe()
        if got:
            return got
        time.sleep(every)
    seen = f"\n{state()}" if state is not None else ""
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}{seen}")


# ---- reading journals and playbook output -----------------------------------------------------

def first(lines: Journal, pattern: str, after: float = 0.0) -> tuple[float, str] | None:
    rx = re.compile(pattern)
    return next(((t, m) for t, m in lines if t >= after and rx.search(m)), None)


def steps(lines: Journal, after: float = 0.0, before: float = math.inf) -> list[tuple[float, int, float]]:
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
