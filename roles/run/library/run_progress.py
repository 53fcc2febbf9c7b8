#!/usr/bin/python
"""Where one training run stands on this node, read from systemd and the trainer's status file."""

from __future__ import annotations

import json
import os
import stat
import time

from ansible.module_utils.basic import AnsibleModule

DOCUMENTATION = r"""
module: run_progress
short_description: Where a nanochat training run stands on this node
description:
  - Reads the state of C(nanochat-train@RUN) from systemd and where the run stands from the
    trainer's status file (C(status.json) in the run's directory, which the node's trainer
    replaces after every step: on the master the run's loss, val bpb, speed verdict and sample;
    elsewhere the loss of that node's ranks), and the trainer's last journal line as it is. Returns
    them, plus one human line, C(progress), that the repository's stdout callback prints while a
    task polls this module.
  - Changes nothing; check mode is supported.
options:
  run:
    description: The run's name (the unit is nanochat-train@RUN).
    type: str
    required: true
  status_file:
    description: The run's status file, C(<runs_dir>/RUN/status.json).
    type: path
    required: true
author: nanochat-lan
"""

EXAMPLES = r"""
- name: Follow the run until its unit ends
  run_progress:
    run: d8
    status_file: /var/lib/nanochat/runs/d8/status.json
  register: run_follow
  until: run_follow.finished
  retries: 720
  delay: 10
"""

RETURN = r"""
state:
  description: ActiveState/SubState of the unit.
  type: str
  returned: always
finished:
  description: Whether the unit has ended (inactive or failed).
  type: bool
  returned: always
status:
  description: The trainer's status file as it stands (empty before its first step).
  type: dict
  returned: always
phase:
  description: What the run does on this node, in words. The unit's state where it is not running;
    C(training), C(starting) or C(done) as the trainer says; C(waiting for the group (Ns)) after its
    ranks stopped at a checkpoint while the unit runs on (its launcher re-forms the group, or waits
    for enough nodes or the master); C(stalled, no step for Ns) when the newest step is older than
    5 of its own step times and a minute. Neither of the last two has an ETA.
  type: str
  returned: always
nodes:
  description: The inventory places (node ranks) of the nodes in the run's group, as this node's
    trainer last saw it (an elastic launch), or null.
  type: list
  returned: always
left:
  description: The inventory places (as strings) of the nodes out of the run's group now that were
    in it, each with C(step) and C(time) (epoch seconds) of the last status written while they were
    (an elastic launch; empty otherwise).
  type: dict
  returned: always
mlflow_charts:
  description: Where the run's charts open in MLflow (the server's page, or a local store's
    C(mlflow ui) command and page), as rank 0 wrote it once its store started the run; empty
    before that, on other nodes, and without MLflow.
  type: str
  returned: always
gpu_note:
  description: This node's CUDA GPU that the run, training on CPU, leaves idle, with both devices'
    measured matmul peaks, as the node's trainer said it at its start; empty where there is none.
  type: str
  returned: always
progress:
  description: One line, e.g. C(d8 step 120/500 (24.0%) loss 4.1000 | 912 tok/s | elapsed 3.2m eta 10.1m).
  type: str
  returned: always
"""

PROPERTIES = ("ActiveState", "SubState", "Result", "NRestarts", "ExecMainStatus", "UnitFileState")
READS_VERSION = 1  # the status file's keys this module knows (nanochat_cpu/run_status.py)


def unit_properties(module: AnsibleModule, unit: str) -> dict[str, str]:
    argv = ["systemctl", "show", unit, "--no-pager"] + [f"--property={p}" for p in PROPERTIES]
    rc, out, err = module.run_command(argv)
    if rc != 0:
        module.fail_json(msg=f"systemctl show {unit} failed: {err.strip()}")
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def last_line(module: AnsibleModule, run: str) -> str:
    """The trainer's newest line as it is (its own, not systemd's about the unit): for people."""
    argv = ["journalctl", "--no-pager", "--output=cat", f"--identifier=nanochat-train-{run}", "--lines=1"]
    rc, out, _ = module.run_command(argv)
    return out.strip().splitlines()[-1] if rc == 0 and out.strip() else ""


MAX_STATUS_BYTES = 1 << 20  # the trainer writes a few hundred bytes


def read_status(path: str) -> dict:
    """The status file, or {} where the run has not written one yet (before its first step).

    The service user owns the run's directory and this module runs as root: a link, a FIFO or an
    endless file put there is not followed, waited on or read whole."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:  # not written yet, or a link
        return {}
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return {}
        data = f.read(MAX_STATUS_BYTES + 1)
    try:
        status = json.loads(data) if len(data) <= MAX_STATUS_BYTES else {}
    except ValueError:  # a rename makes a torn read impossible: this is not the trainer's file
        return {}
    return status if isinstance(status, dict) else {}


def columns(status: dict) -> dict:
    """The status table's cells: step, loss, tok/s, ETA, val bpb (None where not known yet)."""
    step, total = status.get("step"), status.get("total")
    if step is None:
        return {"step": None, "total": total, "percent": None, "loss": None, "tok_s": None, "elapsed": None,
                "eta": None, "val_bpb": None}

    def fixed(value, digits: int) -> str | None:
        return None if value is None else f"{value:.{digits}f}"

    return {"step": step, "total": total, "percent": round(100 * step / total, 1) if total else None,
            "loss": fixed(status.get("loss"), 4), "tok_s": fixed(status.get("tok_per_s"), 0),
            "elapsed": status.get("elapsed"), "eta": status.get("eta"), "val_bpb": fixed(status.get("val_bpb"), 4)}


STALL_MIN_S = 60.0  # a step may take this long without the run being called stalled...
STALL_STEPS = 5  # ...or this many of its own last step's time


def phase(unit_state: str, status: dict, now: float) -> str:
    """What the run does on this node, in words (RETURN's `phase`): a run whose steps stopped coming
    is not called training, and gets no ETA."""
    if not unit_state.startswith("active/"):
        return unit_state
    state = status.get("state") or "starting"
    age = now - (status.get("updated") or now)
    if state == "stopped":
        return f"waiting for the group ({age:.0f}s)"
    if state == "training" and age > max(STALL_MIN_S, STALL_STEPS * (status.get("step_s") or 0.0)):
        return f"stalled, no step for {age:.0f}s"
    return state


def progress_line(run: str, state: str, restarts: str, p: dict, doing: str | None = None) -> str:
    """`doing`: phase(); the unit's state where not given."""
    doing = doing or state
    if p["step"] is None:
        return f"{run}: {doing}, no step yet"
    if doing.startswith(("waiting", "stalled")):  # a run that is not stepping has no ETA
        p = {**p, "eta": "-"}
    parts = [f"{run} step {p['step']}/{p['total']} ({p['percent']}%) loss {p['loss']}",
             f"{p['tok_s']} tok/s", f"elapsed {p['elapsed'] or '?'} eta {p['eta'] or '?'}"]
    if p["val_bpb"]:
        parts.append(f"val_bpb {p['val_bpb']}")
    if restarts not in ("", "0"):
        parts.append(f"{restarts} restart(s)")
    if doing not in ("training", "done", "active/running", "inactive/dead"):  # the step says enough there
        parts.append(doing)
    return " | ".join(parts)


def main() -> None:
    module = AnsibleModule(
        argument_spec={"run": {"type": "str", "required": True},
                       "status_file": {"type": "path", "required": True}},
        supports_check_mode=True,
    )
    run = module.params["run"]
    unit = f"nanochat-train@{run}.service"
    props = unit_properties(module, unit)
    state = f"{props.get('ActiveState', '?')}/{props.get('SubState', '?')}"
    status = read_status(module.params["status_file"])
    if status.get("version", READS_VERSION) > READS_VERSION:
        module.warn(f"{module.params['status_file']} is version {status['version']}, newer than this role reads "
                    f"({READS_VERSION}): re-run site.yml from the same checkout as the nodes' trainer")
    cells = columns(status)
    restarts = props.get("NRestarts", "0")
    doing = phase(state, status, time.time())
    if doing.startswith(("waiting", "stalled")):
        cells["eta"] = None
    module.exit_json(
        changed=False,
        unit=unit,
        state=state,
        finished=props.get("ActiveState") in ("inactive", "failed"),
        result=props.get("Result", ""),
        exit_status=props.get("ExecMainStatus", ""),
        unit_file_state=props.get("UnitFileState", ""),
        restarts=restarts,
        status=status,
        verdict=status.get("verdict") or "",
        sample=status.get("sample") or "",
        mlflow_charts=status.get("mlflow_charts") or "",
        gpu_note=status.get("gpu_note") or "",
        last_line=last_line(module, run),
        phase=doing,
        nodes=status.get("nodes"),
        left=status.get("left") or {},
        progress=progress_line(run, state, restarts, cells, doing),
        **cells,
    )


if __name__ == "__main__":
    main()
