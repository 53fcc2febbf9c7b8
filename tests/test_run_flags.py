"""The trainer's argv a train.yml run gets from its settings, pinned.

The role's `validate` builds the flags and `node_args` adds the node's paths; the unit's env file
carries the result as TRAIN_ARGS, which systemd splits at whitespace. These argvs were taken from
the role as it was before the flags were built in Python (since in TrainConfig's order, where the
flags are named), for settings that reach every branch
(defaults, each work split, total_batch_size auto and given, extra flags, extra-vars given as
JSON numbers): a change that moves, drops or rewords one flag shows here.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_roles import LOCALHOST_INV, ROOT, env, tool

# node_args' inputs that come from cluster_facts on a real node
NODE_FACTS = {
    "cluster_facts_paths": {"data_dir": "/d", "tokenizer_dir": "/t", "runs_dir": "/r"},
    "run_id": "r1",  # the run's id (node_args' own cases: test_the_run_id_is_the_masters_or_a_new_one)
    "cluster_facts_mlflow_server": True,
    "cluster_facts_master_addr": "10.0.0.1",
    "cluster_facts_ports": {"mlflow": 5000},
    "cluster_facts_hybrid_threads": "auto",  # omp_num_threads unset or auto: the trainer's default, not said
}

SHOW = """- hosts: localhost
  gather_facts: false
  tasks:
    - ansible.builtin.import_role:
        name: run
        tasks_from: validate
    - ansible.builtin.import_role:
        name: run
        tasks_from: node_args
    - ansible.builtin.copy:
        content: '{{ run_config_node_train_args | trim }}'
        dest: %s
        mode: '0644'
"""

DEFAULT_FLAGS = (
    "--run-name d4 --device cpu --dtype auto --compile auto --depth 4 --max-seq-len 512 --device-batch-size 2 "
    "--total-batch-size {total} --packing bestfit --num-iterations 200 --grad-comm-dtype bfloat16 "
    "--param-comm-dtype bfloat16 --sync-every auto --outer-lr 1.0 --outer-momentum 0.0 --outer-overlap auto "
    "--outer-compress none --sync-warmup-ratio 0.05 --eval-every 100 --eval-tokens 16384 --sample-every 100 "
    "--checkpoint-every 50 "
    "--resume auto --seed 42 --rank-batch-sizes {split}"
)
NODE_FLAGS = " --data-dir /d --tokenizer-dir /t --out-dir /r/{run} --run-id r1 --tracking-uri http://10.0.0.1:5000"

CASES = {
    "defaults": ({}, [], DEFAULT_FLAGS.format(total=2048, split="auto") + NODE_FLAGS.format(run="d4")),
    "inventory split, total given, extra flags": (
        {"workstation": 3, "laptop": 1},
        ["-e", "work_split=inventory", "-e", "total_batch_size=8192",
         "-e", "train_extra_args='--collective-timeout 60 --matrix-lr 0.01'"],
        DEFAULT_FLAGS.format(total=8192, split="3,1") + " --collective-timeout 60 --matrix-lr 0.01"
        + NODE_FLAGS.format(run="d4"),
    ),
    "inventory split, total auto": (
        {"workstation": 2, "laptop": 1},
        ["-e", "work_split=inventory"],
        DEFAULT_FLAGS.format(total=1536, split="2,1") + NODE_FLAGS.format(run="d4"),
    ),
    "even split, every setting given": (
        {},
        ("-e work_split=even -e depth=8 -e max_seq_len=256 -e device_batch_size=4 -e num_iterations=500 "
         "-e eval_every=-1 -e sample_every=0 -e checkpoint_every=0 -e without_checkpoints=true -e eval_tokens=8192 "
         "-e dtype=float32 "
         "-e compile=off -e resume=never -e seed=7 -e packing=stream -e sync_every=8 -e outer_lr=0.7 "
         "-e outer_momentum=0.9 -e outer_overlap=on -e outer_compress=int4 -e sync_warmup_ratio=0 "
         "-e grad_comm_dtype=float32 "
         "-e param_comm_dtype=float32 -e run_name=pinned").split(),
        "--run-name pinned --device cpu --dtype float32 --compile off --depth 8 --max-seq-len 256 "
        "--device-batch-size 4 --total-batch-size 2048 --packing stream --num-iterations 500 "
        "--grad-comm-dtype float32 --param-comm-dtype float32 --sync-every 8 --outer-lr 0.7 --outer-momentum 0.9 "
        "--outer-overlap on --outer-compress int4 --sync-warmup-ratio 0 --eval-every -1 --eval-tokens 8192 "
        "--sample-every 0 --checkpoint-every 0 --resume never --seed 7" + NODE_FLAGS.format(run="pinned"),
    ),
    "extra-vars as JSON numbers": (
        {},
        ["-e", json.dumps({"depth": 6, "outer_lr": 0.5, "total_batch_size": 4096, "train_device": "cpu",
                           "sync_every": 1, "seed": 0})],
        DEFAULT_FLAGS.format(total=4096, split="auto").replace("--depth 4", "--depth 6")
        .replace("--seed 42", "--seed 0").replace("--run-name d4", "--run-name d6")
        .replace("--sync-every auto", "--sync-every 1").replace("--outer-lr 1.0", "--outer-lr 0.5")
        + NODE_FLAGS.format(run="d6"),
    ),
    "a node whose omp_num_threads is a number": (
        {},
        ["-e", "cluster_facts_hybrid_threads=off"],
        DEFAULT_FLAGS.format(total=2048, split="auto") + NODE_FLAGS.format(run="d4") + " --hybrid-threads off",
    ),
}


@pytest.mark.parametrize(("rows", "extra", "expect"), CASES.values(), ids=list(CASES))
def test_the_unit_gets_the_same_argv(tmp_path: Path, rows: dict[str, int], extra: list[str], expect: str) -> None:
    (tmp_path / "localhost.yml").write_text(LOCALHOST_INV)
    (tmp_path / "rows.yml").write_text("all:\n  hosts:\n" + "".join(
        f"    {host}: {{train_rows: {value}}}\n" for host, value in rows.items()))
    (tmp_path / "show.yml").write_text(SHOW % (tmp_path / "train_args"))
    res = subprocess.run(
        [tool("ansible-playbook"), "-i", "inventory/example", "-i", str(tmp_path / "localhost.yml"), "-i",
         str(tmp_path / "rows.yml"), str(tmp_path / "show.yml"), "-e", json.dumps(NODE_FACTS), *extra],
        cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300,
    )
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    train_args = (tmp_path / "train_args").read_text()
    assert "\n" not in train_args, repr(train_args)
    assert train_args.split() == expect.split()


def test_the_run_id_is_the_masters_or_a_new_one(tmp_path: Path) -> None:
    """No -e run_id: the id in the master's env file of the run, none where that file has none (a
    run started before ids: the trainer takes its checkpoints'), or for a run the master never ran
    a new one; -e run_id wins, and a bad one is refused by name."""
    (tmp_path / "localhost.yml").write_text(LOCALHOST_INV)
    (tmp_path / "show.yml").write_text(SHOW % (tmp_path / "train_args"))
    (tmp_path / "d4.env").write_text("NNODES=2\nTRAIN_ARGS=--depth 4 --out-dir /r/d4 --run-id 0a1b2c --seed 1\n")
    facts = {**NODE_FACTS, "cluster_facts_master_host": "localhost",
             "cluster_facts_paths": {**NODE_FACTS["cluster_facts_paths"], "config_dir": str(tmp_path)}}
    del facts["run_id"]

    def run_id_of(*extra: str) -> str | None:
        res = subprocess.run(
            [tool("ansible-playbook"), "-i", "inventory/example", "-i", str(tmp_path / "localhost.yml"),
             str(tmp_path / "show.yml"), "-e", json.dumps(facts), *extra],
            cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
        if res.returncode:
            return res.stdout
        found = re.search(r"--run-id (\S+)", (tmp_path / "train_args").read_text())
        return found and found[1]

    assert run_id_of() == "0a1b2c"
    (tmp_path / "old.env").write_text("TRAIN_ARGS=--depth 4 --out-dir /r/old --seed 1\n")  # started before ids
    assert run_id_of("-e", "run_name=old") is None
    assert run_id_of("-e", "run_id=chosen.1") == "chosen.1"
    assert re.fullmatch("[0-9a-f]{32}", run_id_of("-e", "run_name=never-ran"))
    assert "run_id=../x must be 1-64 letters" in run_id_of("-e", "run_id=../x")


# ---- the same in Python: nanochat_cpu.run_args, no Ansible --------------------------------------

SETTINGS = {  # validate's defaults for the example inventory's two one-rank nodes
    "run_name": "d4", "depth": 4, "max_seq_len": 512, "device_batch_size": 2, "total_batch_size": "auto",
    "num_iterations": 200, "eval_every": 100, "eval_tokens": 16384, "sample_every": 100, "checkpoint_every": 50,
    "train_device": "", "dtype": "auto", "compile": "auto", "resume": "auto", "seed": 42, "packing": "bestfit",
    "work_split": "auto", "sync_every": "auto", "outer_lr": 1.0, "outer_momentum": 0.0, "outer_overlap": "auto",
    "outer_compress": "none",
    "sync_warmup_ratio": 0.05, "grad_comm_dtype": "bfloat16", "param_comm_dtype": "bfloat16", "extra_args": "",
    "device": "cpu", "train_rows": [2, 2], "nproc_per_node": [1, 1],
}


def test_every_run_flag_is_a_trainer_flag() -> None:
    from nanochat_cpu import config
    from nanochat_cpu.run_args import RUN_FLAGS

    fields = {f.name for f in config.dataclasses.fields(config.TrainConfig)}
    assert set(RUN_FLAGS) <= fields


def test_run_args_builds_the_pinned_argv() -> None:
    from nanochat_cpu.run_args import run_args

    assert run_args(SETTINGS) == {"ok": True, "argv": DEFAULT_FLAGS.format(total=2048, split="auto").split()}
    inventory = {**SETTINGS, "work_split": "inventory", "train_rows": ["2", "1"], "extra_args": " --seed 3 "}
    assert run_args(inventory)["argv"] == (DEFAULT_FLAGS.format(total=1536, split="2,1") + " --seed 3").split()
    even = run_args({**SETTINGS, "work_split": "even", "nproc_per_node": [2, 1]})["argv"]
    assert "--rank-batch-sizes" not in even and even[even.index("--total-batch-size") + 1] == "3072"


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({"depth": "eight"}, "depth=eight must be a positive integer (number of transformer blocks); pass e.g. "
                             "-e depth=8"),
        ({"dtype": "fp16"}, "dtype=fp16 must be one of: auto, float32, bfloat16 (-e dtype=auto)"),
        ({"total_batch_size": "3000", "device_batch_size": "1", "max_seq_len": "256"},
         "total_batch_size=3000 must be auto or a positive multiple of device_batch_size x max_seq_len x world_size "
         "= 1 x 256 x 2 = 512 (world_size = nproc_per_node summed over the 2 nodes). Nearest valid "
         "total_batch_size: 2560 or 3072 (-e total_batch_size=2560), or change device_batch_size / max_seq_len."),
        ({"total_batch_size": "1000", "max_seq_len": "256", "work_split": "inventory", "train_rows": ["3", "1"]},
         "total_batch_size=1000 must be auto or a positive multiple of the sum of every rank's train_rows x "
         "max_seq_len = 3+1 x 256 = 1024 (world_size = nproc_per_node summed over the 2 nodes). Nearest valid "
         "total_batch_size: 1024 (-e total_batch_size=1024), or change device_batch_size / max_seq_len."),
        ({"extra_args": "--matrix-lr fast"}, "the trainer rejects its flags: argument --matrix-lr: invalid float "
                                             "value: 'fast'. Fix: correct train_extra_args (--matrix-lr fast) or the "
                                             "extra-var that sets the flag"),
        ({"extra_args": "--device tpu"}, "the trainer rejects its flags: argument --device: invalid choice: 'tpu'"),
        ({"sync_every": 1, "outer_overlap": "on"}, "outer_overlap=on overlaps the outer syncs of local steps: it "
                                                   "needs --sync-every above 1 or auto ("),
        ({"sync_every": 1, "outer_compress": "int8"}, "outer_compress=int8 compresses the outer syncs of local "
                                                       "steps: it needs --sync-every above 1 or auto ("),
        ({"seed": "4\n5"}, "seed='4\\n5' holds a line break, which would cut the unit's flags short"),
    ],
)
def test_run_args_words_the_problem_in_extra_vars(change: dict[str, object], said: str) -> None:
    from nanochat_cpu.run_args import run_args

    verdict = run_args({**SETTINGS, **change})
    assert not verdict["ok"]
    assert verdict["message"].startswith(said), verdict["message"]


def test_the_problem_comes_with_the_field_s_help_and_an_example() -> None:
    from nanochat_cpu.run_args import run_args

    verdict = run_args({**SETTINGS, "sync_warmup_ratio": 1})
    assert (verdict["field"], verdict["value"], verdict["example"]) == ("sync_warmup_ratio", "1.0", "0.05")
    assert verdict["help"].startswith("with local steps (--sync-every above 1 or auto)")
    assert verdict["flag_message"].startswith("--sync-warmup-ratio=1.0: must be in [0, 1)")


def test_run_args_on_the_command_line_needs_no_torch() -> None:
    """As validate runs it on the controller: one JSON line, exit 2 with the problem on stderr."""
    code = ("import runpy, sys; sys.modules['torch'] = None; "
            "runpy.run_module('nanochat_cpu.run_args', run_name='__main__')")
    ok = subprocess.run([sys.executable, "-c", code, json.dumps(SETTINGS)], cwd=ROOT,
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["argv"][2:4] == ["--device", "cpu"]
    bad = subprocess.run([sys.executable, "-c", code, json.dumps({**SETTINGS, "seed": -1})], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2
    said = "seed=-1 must be >= 0 (RNG seed (same on every rank)); pass e.g. -e seed=42"
    assert json.loads(bad.stdout)["message"] == said
    assert "seed=-1 must be >= 0" in bad.stderr


# ---- the one table of defaults (docs/INVENTORY.md) ----------------------------------------------

def defaults_table() -> dict[str, list[str]]:
    """docs/INVENTORY.md's table of the run's defaults: extra-var -> [flag, trainer, train.yml, why]."""
    text = (ROOT / "docs/INVENTORY.md").read_text()
    table = text.split("| extra-var | trainer flag | trainer default | train.yml default |", 1)[1].split("\n\n")[0]
    rows = {}
    for line in table.splitlines()[2:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        rows[cells[0].strip("`")] = cells[1:]
    return rows


def role_defaults() -> dict[str, str | None]:
    """Each run_config_* extra-var and its default in roles/run/defaults/main.yml (None: an expression)."""
    text = (ROOT / "roles/run/defaults/main.yml").read_text()
    found = re.findall(r'^run_config_\w+: "\{\{ (\w+) \| default\((.*)\) \}\}"$', text, re.MULTILINE)
    return {name: value.strip("'") if re.fullmatch(r"'[^']*'|[\w.]+", value) else None for name, value in found}


def test_the_defaults_table_names_every_flag_a_run_sets_with_both_defaults() -> None:
    """Both defaults as the code has them, and a reason wherever they differ."""
    from nanochat_cpu import config
    from nanochat_cpu.run_args import RUN_FLAGS

    table, role = defaults_table(), role_defaults()
    assert set(role) <= set(table), f"extra-vars of the run role missing from the table: {set(role) - set(table)}"
    flags = {cells[0].strip("`"): extra_var for extra_var, cells in table.items()}
    assert {"--" + name.replace("_", "-") for name in RUN_FLAGS} <= set(flags)
    trainer_defaults = {f.name: f.default for f in config.dataclasses.fields(config.TrainConfig)}
    for flag, extra_var in flags.items():
        field = flag.removeprefix("--").replace("-", "_")
        trainer, ours, why = table[extra_var][1:]
        if field in trainer_defaults and trainer.startswith("`"):
            assert trainer == f"`{trainer_defaults[field]}`", (extra_var, trainer)
        if role.get(extra_var) is not None and re.fullmatch(r"`[^`]*`", ours):
            assert ours.strip('`"') == role[extra_var], (extra_var, ours, role[extra_var])
        assert trainer == ours or why, f"{extra_var}: the defaults differ and the table does not say why"
