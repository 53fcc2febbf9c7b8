"""A train.yml run's trainer flags, built from the run's settings and judged on the controller.

`python -m nanochat_cpu.run_args '<settings JSON>'` is what the run role's validate runs, so the
role keeps no list of flags: it passes the options of its entry point (the role's run_config_*
variables, the prefix dropped: depth, work_split, extra_args, ...) with what it derived from the
inventory (device, each node's train_rows and nproc_per_node), and gets back the argv and the
trainer's own verdict on it (`check`: its parser and validate()), worded in the extra-vars
that set the flags; `python -m nanochat_cpu.run_args check <trainer flags>` gives that verdict
on flags as they are. The controller has the checkout, not necessarily torch: like config.py,
this module imports none.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from .config import POSITIVE_FIELDS, ConfigError, TrainConfig, build_parser, validate, world_size_from_env

# The flags every run sets, in TrainConfig's order (train_extra_args come last, so a flag there
# wins), each with the value the controller suggests when the extra-var of the same name is wrong:
# TrainConfig's "run_example" metadata, so a flag is named in one place.
RUN_FLAGS: dict[str, str | None] = {f.name: f.metadata["run_example"] for f in dataclasses.fields(TrainConfig)
                                    if "run_example" in f.metadata}
# What validate derives besides the settings: how each micro-step's rows are split among the ranks,
# the extra flags, and the inventory's nodes in rank order.
RUN_INPUTS = ("work_split", "extra_args", "train_rows", "nproc_per_node")


def as_text(value: object) -> str:
    """A setting as Ansible prints it into a template: None as nothing, the rest as str() does."""
    return "" if value is None else str(value)


def as_int(value: Any) -> int:
    """A setting as Jinja's `| int` reads it (0 where it is no number): total_batch_size=auto is
    computed from values the trainer's check has yet to judge, and names them when they are junk."""
    try:
        return int(value, 10) if isinstance(value, str) else int(value)
    except (TypeError, ValueError):
        try:
            return int(float(value))
        except (TypeError, ValueError, OverflowError):
            return 0


def rank_rows(settings: dict[str, Any]) -> list[int]:
    """work_split=inventory: each rank's rows per micro-step, in rank order (each node's ranks in a row)."""
    rows = []
    for node_rows, nproc in zip(settings["train_rows"], settings["nproc_per_node"], strict=True):
        rows += [as_int(node_rows)] * as_int(nproc)
    return rows


def world_size_of(settings: dict[str, Any]) -> int:
    return sum(as_int(nproc) for nproc in settings["nproc_per_node"])


def unit_tokens(settings: dict[str, Any]) -> int:
    """Tokens of one micro-step over all ranks: what total_batch_size=auto means, and must divide."""
    if settings["work_split"] == "inventory":
        rows = sum(rank_rows(settings))
    else:
        rows = as_int(settings["device_batch_size"]) * world_size_of(settings)
    return rows * as_int(settings["max_seq_len"])


def split_flags(settings: dict[str, Any]) -> str:
    split = settings["work_split"]
    if split == "auto":
        return "--rank-batch-sizes auto"
    if split == "inventory":
        return "--rank-batch-sizes " + ",".join(str(rows) for rows in rank_rows(settings))
    if split == "even":
        return ""
    raise ValueError(f"work_split={split}: must be one of auto, even, inventory (validate checks it first)")


def run_argv(settings: dict[str, Any]) -> list[str]:
    """The trainer's argv for a run's settings (without the node's paths, which node_args adds)."""
    missing = [name for name in (*RUN_FLAGS, *RUN_INPUTS) if name not in settings]
    if missing:
        raise ValueError(f"the run's settings lack {', '.join(missing)}")
    values = {name: as_text(settings[name]) for name in RUN_FLAGS}
    for name, value in values.items():  # a line break would end the env file's TRAIN_ARGS there
        if "\n" in value or "\r" in value:
            raise ConfigError(f"{name}={value!r} holds a line break, which would cut the unit's flags short (the "
                              f"env file's TRAIN_ARGS is one line); give it on one line")
    if values["total_batch_size"] == "auto":
        values["total_batch_size"] = str(unit_tokens(settings))
    pairs = [f"--{name.replace('_', '-')} {value}" for name, value in values.items()]
    line = " ".join([*pairs, split_flags(settings), as_text(settings["extra_args"])])
    # systemd splits TRAIN_ARGS at whitespace: the argv is that split, so the check judges what the
    # trainer gets (a value with a space in it included)
    return line.split()


def run_args(settings: dict[str, Any]) -> dict[str, Any]:
    """The argv and check()'s verdict on it, the message worded in the extra-vars (see RUN_FLAGS)."""
    try:
        argv = run_argv(settings)
    except ConfigError as exc:
        return {"ok": False, "argv": [], "message": str(exc), "flag_message": str(exc), "field": "", "value": "",
                "problem": "", "valid": [], "help": "", "example": ""}
    verdict = check(argv, world_size_of(settings))
    if verdict["ok"]:
        return {"ok": True, "argv": argv}
    example = RUN_FLAGS.get(verdict["field"])
    message = worded_in_settings(verdict, example, settings)
    return {**verdict, "argv": argv, "message": message, "flag_message": verdict["message"],
            "example": example or ""}


def worded_in_settings(verdict: dict[str, Any], example: str | None, settings: dict[str, Any]) -> str:
    """check()'s problem as the role says it: the extra-var, its value and one to pass instead."""
    field, value, problem = verdict["field"], verdict["value"], verdict["problem"]
    if field == "total_batch_size" and verdict["valid"]:
        return batch_message(value, verdict["valid"], settings)
    if example is not None and verdict["valid"]:
        return f"{field}={value} {problem} (-e {field}={example})"
    if example is not None:
        return f"{field}={value} {problem} ({verdict['help']}); pass e.g. -e {field}={example}"
    return (f"the trainer rejects its flags: {verdict['message']}. Fix: correct train_extra_args "
            f"({as_text(settings['extra_args'])}) or the extra-var that sets the flag")


def batch_message(value: str, valid: list[int], settings: dict[str, Any]) -> str:
    """The batch arithmetic in the inventory's terms (train_rows, nproc_per_node), not the trainer's."""
    seq = as_text(settings["max_seq_len"])
    if settings["work_split"] == "inventory":
        rows = "+".join(str(rows) for rows in rank_rows(settings))
        product = f"the sum of every rank's train_rows x max_seq_len = {rows} x {seq}"
    else:
        product = (f"device_batch_size x max_seq_len x world_size = {as_text(settings['device_batch_size'])} x "
                   f"{seq} x {world_size_of(settings)}")
    nodes = len(settings["nproc_per_node"])
    return (f"total_batch_size={value} must be auto or a positive multiple of {product} = {unit_tokens(settings)} "
            f"(world_size = nproc_per_node summed over the {nodes} nodes). Nearest valid total_batch_size: "
            f"{' or '.join(map(str, valid))} (-e total_batch_size={valid[0]}), or change device_batch_size / "
            f"max_seq_len.")


# ---- the verdict on flags: the trainer's own parser and validate() ------------------------------

def check(argv: list[str], world_size: int) -> dict[str, Any]:
    """The verdict on trainer flags: {"ok": True}, or the problem with its parts (see ConfigError)."""
    parser = build_parser()
    parser.exit_on_error = False  # type and choice errors come back as exceptions, to be reported in parts
    try:
        args, unknown = parser.parse_known_args(argv)
        if unknown:
            raise ConfigError(f"unrecognized arguments: {' '.join(unknown)}")
        validate(TrainConfig(**vars(args)), world_size)
    except argparse.ArgumentError as exc:
        error = parser_problem(exc, argv)
    except ConfigError as exc:
        error = exc
    else:
        return {"ok": True}
    spec = {f.name: f for f in dataclasses.fields(TrainConfig)}.get(error.field)
    return {"ok": False, "message": str(error), "field": error.field, "value": error.value,
            "problem": error.problem, "valid": error.valid, "help": spec.metadata.get("help", "") if spec else ""}


def parser_problem(exc: argparse.ArgumentError, argv: list[str]) -> ConfigError:
    """argparse's complaint (a value of the wrong type, or not one of the choices) in ConfigError's parts."""
    flag = exc.argument_name or ""
    fields = {"--" + f.name.replace("_", "-"): f for f in dataclasses.fields(TrainConfig)}
    if flag not in fields:
        return ConfigError(str(exc))
    f = fields[flag]
    choices = f.metadata.get("choices", ())
    if choices:
        problem = "must be one of: " + ", ".join(choices)
    elif f.name in POSITIVE_FIELDS:
        problem = "must be a positive integer"
    else:
        problem = "must be an integer" if f.type in ("int", int) else "must be a number"
    given = [arg for i, arg in enumerate(argv[1:]) if argv[i] == flag]  # the value after the flag
    return ConfigError(str(exc), f.name, given[-1] if given else "", problem, choices)


def report(verdict: dict) -> int:
    """A controller command's verdict: one JSON line, and the exit code (2 with the problem on stderr)."""
    print(json.dumps(verdict))
    if not verdict["ok"]:
        print(verdict["message"], file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["check"]:
        return report(check(argv[1:], world_size_from_env()))
    if len(argv) != 1:
        print("usage: python -m nanochat_cpu.run_args '<a run's settings as JSON>'  (train.yml's validate)\n"
              "       python -m nanochat_cpu.run_args check <trainer flags>  (WORLD_SIZE from the environment)\n"
              "prints one JSON line; exit 0 when the trainer would accept the flags, 2 with the problem",
              file=sys.stderr)
        return 2
    return report(run_args(json.loads(argv[0])))


if __name__ == "__main__":
    sys.exit(main())
