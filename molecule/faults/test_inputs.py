"""Bad inputs: each refused naming the host, value and fix, with no node changed (env files, run dirs, units).

Bad extra-vars (type, choice, batch arithmetic), a bad trainer flag, a node without its data dir, an
empty and a corrupt shard pushed consistently, and resuming the node-loss run with a tokenizer from
another corpus (which needs that run's checkpoints: the node-loss case first).
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from nodes import Cluster
from runs import RUN_VARS, Run, refused

CASE = "inputs"
RUN = Run("faults-inputs", 10)
DATA = "/var/lib/nanochat/data/fortunes"
TOKENIZER = "/var/lib/nanochat/tokenizer/fortunes/tokenizer.json"

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


def node_state(c: Cluster) -> dict[str, str]:
    """What train.yml would change on a node: env files, run directories, trainer units started.
    Inactive units are left out: systemd unloads one nothing refers to any more whenever it likes."""
    return {n: c.sh(n, "ls -la --time-style=+%s /etc/nanochat /var/lib/nanochat/runs; "
                       "systemctl list-units 'nanochat-train@*' --all --no-legend --plain "
                       "--state=active,activating,deactivating,reloading,failed", check=False)
            for n in c.nodes}


@pytest.fixture(scope="module", autouse=True)
def state_before(cluster: Cluster) -> dict[str, str]:
    """The nodes before the first refusal (autouse: taken before any test of the case runs)."""
    return node_state(cluster)


# extra-vars: refused on the controller, before any node is contacted
@pytest.mark.parametrize(("name", "value", "want"), [
    ("depth", "eight", "depth=eight must be a positive integer"),
    ("dtype", "fp16", "dtype=fp16 must be one of: auto, float32, bfloat16"),
    ("total_batch_size", 1000, "total_batch_size=1000 must be auto or a positive multiple"),
], ids=["depth", "dtype", "total_batch_size"])
def test_bad_extra_var(cluster: Cluster, case_report: dict, name: str, value: object, want: str) -> None:
    case_report[f"extra_var_{name}"] = refused(cluster, {**RUN.vars, name: value}, want, f"-e {name}={value}")


def test_bad_trainer_flag(cluster: Cluster, case_report: dict) -> None:
    """Refused on the controller, before any node is contacted, by the trainer's own parser."""
    case_report["trainer_flag"] = refused(
        cluster, {**RUN.vars, "train_extra_args": "--matrix-lr fast"},
        "the trainer rejects its flags: argument --matrix-lr: invalid float value: 'fast'",
        "train_extra_args=--matrix-lr fast")


@pytest.fixture
def data_dir_away(cluster: Cluster) -> Iterator[str]:
    node = cluster.workers[0]
    cluster.sh(node, f"mv {DATA} /root/data.away")
    yield node
    cluster.sh(node, f"mv /root/data.away {DATA}", check=False)


def test_missing_data_dir(cluster: Cluster, case_report: dict, data_dir_away: str) -> None:
    node = data_dir_away
    case_report["missing_data_dir"] = refused(cluster, RUN.vars, f"{node}: manifest.json missing",
                                              f"no {DATA} on {node}")


@pytest.fixture
def bad_shards(cluster: Cluster) -> Iterator[None]:
    """An empty shard and a corrupt one, pushed consistently (the manifest describes them)."""
    for n in cluster.nodes:
        cluster.sh(n, f"mkdir -p /root/data.orig && cp -p {DATA}/manifest.json {DATA}/shard_00001.parquet "
                      f"{DATA}/shard_00002.parquet /root/data.orig/ && "
                      f"/opt/nanochat/venv/bin/python -c \"{BAD_SHARDS}\" {DATA}")
    yield
    for n in cluster.nodes:
        cluster.sh(n, f"cp -p /root/data.orig/* {DATA}/ && rm -rf /root/data.orig", check=False)


def test_empty_and_corrupt_shard(cluster: Cluster, case_report: dict, bad_shards: None) -> None:
    """The hashes agree; preflight's `data verify` (which reads every shard) refuses them in the
    words of the trainer's own check."""
    r = refused(cluster, RUN.vars, "shard_00001.parquet: empty shard (0 rows)", "an empty and a corrupt shard")
    assert "shard_00002.parquet: not a readable parquet file" in r["message"], f"corrupt shard not named: {r}"
    case_report["bad_shards"] = r


@pytest.fixture
def foreign_tokenizer(cluster: Cluster, tmp_path: Path) -> Iterator[None]:
    """Every node's tokenizer replaced by one trained on another corpus, once node-loss's run is there."""
    done = [r for r in cluster.sh(cluster.master, "ls /var/lib/nanochat/runs/*/checkpoints/*/COMPLETE "
                                                  "2>/dev/null || true").split() if "faults-loss" in r]
    assert done != [], "no finished run to resume (run the node-loss case first)"
    cluster.sh(cluster.master, "cd /root && /opt/nanochat/venv/bin/python -m nanochat_cpu.data prepare --source "
                               "/usr/share/common-licenses --out other-data --rows-per-group 16 >/dev/null && "
                               "/opt/nanochat/venv/bin/python -m nanochat_cpu.tokenizer train --data-dir other-data "
                               "--vocab-size 512 --out other-tok >/dev/null")
    foreign = tmp_path / "faults-foreign-tokenizer.json"
    subprocess.run(["podman", "cp", f"{cluster.ct(cluster.master)}:/root/other-tok/tokenizer.json", str(foreign)],
                   check=True)
    for n in cluster.nodes:
        cluster.sh(n, f"cp -p {TOKENIZER} /root/tokenizer.orig")
        subprocess.run(["podman", "cp", str(foreign), f"{cluster.ct(n)}:{TOKENIZER}"], check=True)
    yield
    for n in cluster.nodes:
        cluster.sh(n, f"cp -p /root/tokenizer.orig {TOKENIZER} && rm -rf /root/tokenizer.orig /root/other-*",
                   check=False)


def test_foreign_tokenizer_for_a_finished_run(cluster: Cluster, case_report: dict,
                                                 foreign_tokenizer: None) -> None:
    resume_vars = {**RUN_VARS, "run_name": "faults-loss", "num_iterations": 160}
    case_report["foreign_tokenizer"] = refused(cluster, resume_vars, "was trained with another tokenizer",
                                               "resuming faults-loss with a foreign tokenizer")


def test_refusals_left_every_node_as_it_was(cluster: Cluster, state_before: dict[str, str]) -> None:
    after = node_state(cluster)
    assert after == state_before, f"a refused train.yml changed a node: {state_before} -> {after}"
