#!/usr/bin/python
"""Where one training run stands on this node, read from systemd and the run's journal."""

from __future__ import annotations

import re

from ansible.module_utils.basic import AnsibleModule

DOCUMENTATION = r"""
module: run_progress
short_description: Where a nanochat training run stands on this node
description:
  - Reads the state of C(nanochat-train@RUN) from systemd and the trainer's last lines of each
    kind from its journal (step, evaluation, cluster speed verdict, sample, last line), and returns
    them parsed, plus one human line, C(progress), that the repository's stdout callback prints
    while a task polls this module.
  - Changes nothing; check mode is supported.
options:
  run:
    description: The run's name (the unit is nanochat-train@RUN).
    type: str
    required: true
  own_ranks_only:
    description:
      - false (the master) reads rank 0's step lines, whose loss is the run's; true (any other node)
        reads this node's own ranks' lines, whose C(rank_loss) is their batch's.
    type: bool
    default: false
author: nanochat-lan
"""

EXAMPLES = r"""
- name: Follow the run until its unit ends
  run_progress:
    run: d8
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
progress:
  description: One line, e.g. C(d8 step 120/500 (24.0%) loss 4.1 | 912 tok/s | elapsed 3.2m eta 10.1m | val_bpb 1.52).
  type: str
  returned: always
"""

# what each kind of trainer line looks like (nanochat_cpu/train.py, work_split.py); journalctl's
# --grep takes PCRE2, and the lines are parsed again here
GREPS = {
    "step": r"\] step [0-9]+/[0-9]+.* loss=",
    "own_step": r"\] step [0-9]+/[0-9]+.* (rank_)?loss=",
    "eval": r"\] eval step [0-9]+ val_bpb=",
    "verdict": r"THAN ONE NODE: ",
    "sample": r"\] sample step [0-9]+: ",
}
FIELDS = {
    "loss": r"(?:rank_)?loss=([-0-9.naif]+)",
    "tok_s": r"tok_per_s=([0-9]+)",
    "elapsed": r"elapsed=(\S+)",
    "eta": r"eta=(\S+)",
}
PROPERTIES = ("ActiveState", "SubState", "Result", "NRestarts", "ExecMainStatus", "UnitFileState")


def unit_properties(module: AnsibleModule, unit: str) -> dict[str, str]:
    argv = ["systemctl", "show", unit, "--no-pager"] + [f"--property={p}" for p in PROPERTIES]
    rc, out, err = module.run_command(argv)
    if rc != 0:
        module.fail_json(msg=f"systemctl show {unit} failed: {err.strip()}")
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def last_line(module: AnsibleModule, run: str, grep: str | None) -> str:
    """The trainer's newest line (its own, not systemd's about the unit), of a kind if grep is given."""
    argv = ["journalctl", "--no-pager", "--output=cat", f"--identifier=nanochat-train-{run}", "--lines=1"]
    if grep:
        argv.append(f"--grep={grep}")
    rc, out, _ = module.run_command(argv)
    return out.strip().splitlines()[-1] if rc == 0 and out.strip() else ""  # rc 1: nothing matched


def after(prefix_re: str, line: str) -> str:
    """The text after the trainer's `[host rank r/w] <prefix>`."""
    m = re.search(prefix_re + r"(.*)$", line)
    return m.group(1).strip() if m else ""


def parse_step(line: str) -> dict:
    m = re.search(r"step ([0-9]+)/([0-9]+)", line)
    if not m:
        return {"step": None, "total": None, "percent": None}
    step, total = int(m.group(1)), int(m.group(2))
    out = {"step": step, "total": total, "percent": round(100 * step / total, 1) if total else None}
    for name, pattern in FIELDS.items():
        found = re.search(pattern, line)
        out[name] = found.group(1) if found else None
    return out


def progress_line(run: str, state: str, restarts: str, p: dict) -> str:
    if p["step"] is None:
        return f"{run}: {state}, no step yet"
    parts = [f"{run} step {p['step']}/{p['total']} ({p['percent']}%) loss {p['loss']}",
             f"{p['tok_s']} tok/s", f"elapsed {p['elapsed'] or '?'} eta {p['eta'] or '?'}"]
    if p["val_bpb"]:
        parts.append(f"val_bpb {p['val_bpb']}")
    if restarts not in ("", "0"):
        parts.append(f"{restarts} restart(s)")
    if state not in ("active/running", "inactive/dead"):  # ended well or running: the step says enough
        parts.append(state)
    return " | ".join(parts)


def main() -> None:
    module = AnsibleModule(
        argument_spec={"run": {"type": "str", "required": True},
                       "own_ranks_only": {"type": "bool", "default": False}},
        supports_check_mode=True,
    )
    run = module.params["run"]
    unit = f"nanochat-train@{run}.service"
    props = unit_properties(module, unit)
    state = f"{props.get('ActiveState', '?')}/{props.get('SubState', '?')}"
    step_line = last_line(module, run, GREPS["own_step" if module.params["own_ranks_only"] else "step"])
    parsed = parse_step(step_line)
    eval_line = last_line(module, run, GREPS["eval"])
    found = re.search(r"val_bpb=([0-9.]+)", eval_line)
    parsed["val_bpb"] = found.group(1) if found else None
    restarts = props.get("NRestarts", "0")
    module.exit_json(
        changed=False,
        unit=unit,
        state=state,
        finished=props.get("ActiveState") in ("inactive", "failed"),
        result=props.get("Result", ""),
        exit_status=props.get("ExecMainStatus", ""),
        unit_file_state=props.get("UnitFileState", ""),
        restarts=restarts,
        step_line=step_line,
        verdict=after(r"\] ", last_line(module, run, GREPS["verdict"])),
        sample=after(r"\] sample step [0-9]+: ", last_line(module, run, GREPS["sample"])),
        last_line=last_line(module, run, None),
        progress=progress_line(run, state, restarts, parsed),
        **parsed,
    )


if __name__ == "__main__":
    main()
