"""Repository hygiene for the Ansible side: roles, playbooks, inventory, lint.

Runs without any node: every role is complete (a task file per entry point; defaults and argument
specs with exactly the same option names, each read somewhere) and its README follows one outline,
every module is named by FQCN, every playbook passes --syntax-check, yamllint and ansible-lint
(production profile) pass, the interface filter picks the right NIC, lan_subnet must be a private
range, the firewall's filters want each node's address and find only our stale ufw rules, a bad
train.yml extra-var ends the playbook before any node play starts, and the trainer's own check it
runs on the controller (python -m nanochat_cpu.run_args, through its check) needs no torch.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
ROLES_DIR = ROOT / "roles"
ROLES = sorted(p.name for p in ROLES_DIR.iterdir() if p.is_dir())
BIN = Path(sys.executable).parent
TOP_PLAYBOOKS = ["site.yml", "train.yml", "stop.yml", "status.yml"]
PLAYBOOKS = TOP_PLAYBOOKS + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "playbooks").glob("*.yml"))
EXPECTED_ROLES = {"python_env", "torch", "firewall", "dataset", "trainer", "mlflow"}


def tool(name: str) -> str:
    """The venv's copy of a tool (the one the project pins), else the one on PATH."""
    path = BIN / name
    if path.exists():
        return str(path)
    found = shutil.which(name)
    assert found, f"{name} is not installed: it is in the project's requirements (make setup)"
    return found


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PATH"] = f"{BIN}{os.pathsep}{e.get('PATH', '')}"
    e["ANSIBLE_CONFIG"] = str(ROOT / "ansible.cfg")
    e.setdefault("ANSIBLE_NOCOLOR", "1")
    e.setdefault("ANSIBLE_LOCAL_TEMP", "/tmp/ansible-local-tests")
    return e


def load(path: Path):
    with open(path) as f:
        return yaml.safe_load(f)


# ---- role structure ------------------------------------------------------------------------

def test_the_architecture_roles_exist() -> None:
    assert EXPECTED_ROLES <= set(ROLES)


def entry_points(role: str) -> dict:
    return load(ROLES_DIR / role / "meta/argument_specs.yml")["argument_specs"]


@pytest.mark.parametrize("role", ROLES)
def test_role_is_complete(role: str) -> None:
    """A role is used whole (tasks/main.yml) or through task files: each an entry point of its arg specs."""
    base = ROLES_DIR / role
    for rel in ("README.md", "defaults/main.yml", "meta/argument_specs.yml", "meta/main.yml"):
        assert (base / rel).is_file(), f"roles/{role}/{rel} is missing"
    assert entry_points(role), f"roles/{role}: argument_specs names no entry point"
    for entry in entry_points(role):
        assert (base / "tasks" / f"{entry}.yml").is_file(), f"roles/{role}: entry point {entry} lacks its task file"
    readme = (base / "README.md").read_text()
    assert readme.startswith(f"# {role}"), f"roles/{role}/README.md must start with '# {role}'"


@pytest.mark.parametrize("role", ROLES)
def test_defaults_and_argument_specs_name_the_same_options(role: str) -> None:
    """Every default is an option of some entry point, every option has a default and is used."""
    defaults = load(ROLES_DIR / role / "defaults/main.yml") or {}
    spec_names: set[str] = set()
    for entry, spec in entry_points(role).items():
        options = spec.get("options") or {}
        for name, option in options.items():
            assert option.get("description"), f"roles/{role}: {entry}.{name} has no description"
            assert option.get("type"), f"roles/{role}: {entry}.{name} has no type"
        spec_names |= set(options)
    assert set(defaults) == spec_names, (
        f"roles/{role}: only in defaults/main.yml: {sorted(set(defaults) - spec_names)}; "
        f"only in meta/argument_specs.yml: {sorted(spec_names - set(defaults))}"
    )
    for name in defaults:
        assert name.startswith(role + "_"), f"roles/{role}: option {name} lacks the role prefix"
    used = "".join(p.read_text() for sub in ("tasks", "templates", "handlers")
                   for p in sorted((ROLES_DIR / role / sub).glob("*")))
    unused = sorted(name for name in defaults if name not in used and name not in read_by_run_args(role))
    assert not unused, f"roles/{role}: options no task, template or handler reads: {unused}"


def read_by_run_args(role: str) -> set[str]:
    """The run role's validate passes its options by name to `python -m nanochat_cpu.run_args`,
    which reads those that name a trainer flag or a run input (run_config_depth is depth)."""
    if role != "run":
        return set()
    from nanochat_cpu.run_args import RUN_FLAGS, RUN_INPUTS

    options = entry_points("run")["validate"]["options"]
    return {name for name in options if name.removeprefix("run_config_") in {*RUN_FLAGS, *RUN_INPUTS}}


README_SECTIONS = ("## Variables", "## Example", "## What it changes on the node")


@pytest.mark.parametrize("role", ROLES)
def test_readme_follows_the_outline(role: str) -> None:
    """What it does, variables (in meta/argument_specs.yml, not copied), an example, what it changes."""
    readme = (ROLES_DIR / role / "README.md").read_text()
    missing = [section for section in README_SECTIONS if section not in readme]
    assert not missing, f"roles/{role}/README.md lacks {missing}"
    positions = [readme.find(section) for section in README_SECTIONS]
    assert positions == sorted(positions), f"roles/{role}/README.md: sections out of order"
    assert "meta/argument_specs.yml" in readme, f"roles/{role}/README.md does not point at meta/argument_specs.yml"
    if not (ROLES_DIR / role / "tasks/main.yml").is_file():  # used through task files: list them
        assert "## Task files" in readme, f"roles/{role}/README.md: no '## Task files' section"
        for entry in entry_points(role):
            assert f"`{entry}.yml`" in readme.split("## Task files", 1)[-1], (
                f"roles/{role}/README.md: no '## Task files' entry for {entry}.yml")


# ---- FQCN --------------------------------------------------------------------------------

def _keywords() -> set[str]:
    from ansible.playbook.task import Task

    return set(Task.fattributes) | {"block", "rescue", "always", "local_action"}


def _tasks(items, where: str):
    for task in items or []:
        if not isinstance(task, dict):
            continue
        for section in ("block", "rescue", "always"):
            if section in task:
                yield from _tasks(task[section], where)
        if not any(s in task for s in ("block", "rescue", "always")):
            yield where, task


def _task_files():
    for role in ROLES:
        for sub in ("tasks", "handlers"):
            for path in sorted((ROLES_DIR / role / sub).glob("*.yml")):
                yield path, load(path)
    for pb in PLAYBOOKS:
        for play in load(ROOT / pb) or []:
            for section in ("pre_tasks", "tasks", "post_tasks", "handlers"):
                if section in play:
                    yield ROOT / pb, play[section]
            if "import_playbook" in play or "ansible.builtin.import_playbook" in play:
                assert "ansible.builtin.import_playbook" in play, f"{pb}: import_playbook without FQCN"


def test_every_module_is_named_by_fqcn() -> None:
    """A module of a collection by its FQCN; a role's own module (roles/*/library/) by its file's
    name, which is its canonical name (ansible-lint's fqcn[canonical] asks for it)."""
    keywords = _keywords()
    role_modules = {p.stem for p in ROLES_DIR.glob("*/library/*.py")}
    bad = []
    count = 0
    for path, tasks in _task_files():
        for where, task in _tasks(tasks, str(path.relative_to(ROOT))):
            modules = [k for k in task if k not in keywords and not k.startswith("with_")]
            assert len(modules) == 1, f"{where}: task {task.get('name')!r} has modules {modules}"
            count += 1
            if not re.match(r"^[a-z0-9_]+\.[a-z0-9_]+\.[a-z0-9_]+$", modules[0]) and modules[0] not in role_modules:
                bad.append(f"{where}: {task.get('name')!r} uses {modules[0]}")
    assert count > 100
    assert not bad, "modules without FQCN:\n" + "\n".join(bad)


def test_no_shell_module() -> None:
    """Commands run as argv lists or modules: no shell strings, no pipelines."""
    for path, tasks in _task_files():
        for where, task in _tasks(tasks, str(path.relative_to(ROOT))):
            assert "ansible.builtin.shell" not in task, f"{where}: {task.get('name')!r} uses shell"


# ---- playbooks, lint ------------------------------------------------------------------------

@pytest.mark.parametrize("playbook", PLAYBOOKS)
def test_syntax_check(playbook: str) -> None:
    for inventory in ("inventory/example",):
        res = subprocess.run([tool("ansible-playbook"), "--syntax-check", "-i", inventory, playbook],
                             cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stdout + res.stderr


def test_top_level_playbooks_only_import() -> None:
    for pb in TOP_PLAYBOOKS:
        plays = load(ROOT / pb)
        assert [list(p) for p in plays] == [["name", "ansible.builtin.import_playbook"]], pb
        assert plays[0]["ansible.builtin.import_playbook"] == f"playbooks/{pb}"


def test_yamllint_strict() -> None:
    res = subprocess.run([tool("yamllint"), "-s", "."], cwd=ROOT, env=env(), capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr


def test_ansible_lint_production_profile() -> None:
    res = subprocess.run([tool("ansible-lint"), "--nocolor", "--profile", "production"], cwd=ROOT, env=env(),
                         capture_output=True, text=True, timeout=1200)
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-6000:]


# ---- inventory ---------------------------------------------------------------------------

def _inventory(path: str) -> dict:
    res = subprocess.run([tool("ansible-inventory"), "-i", path, "--list"], cwd=ROOT, env=env(),
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr

    return json.loads(res.stdout)


def test_the_mlflow_role_makes_the_experiment_the_trainer_logs_to() -> None:
    """The role creates the experiment and grants the trainer's user EDIT on it alone: a name apart
    from the trainer's would leave the trainer logging to one it may not touch (403)."""
    from nanochat_cpu.tracking import EXPERIMENT, KIND, KIND_TAG
    assert load(ROLES_DIR / "mlflow" / "vars" / "main.yml")["mlflow_experiment"] == EXPERIMENT
    made = next(t for t in load(ROLES_DIR / "mlflow" / "tasks" / "trainer_user.yml")
                if t["name"].startswith("Create the experiment"))
    assert made["ansible.builtin.uri"]["body"]["tags"] == [{"key": KIND_TAG, "value": KIND}]


def test_example_inventory_is_the_field_reports_cluster() -> None:
    inv = _inventory("inventory/example")
    assert inv["master"]["hosts"] == ["workstation"]
    assert inv["workers"]["hosts"] == ["laptop"]
    assert set(inv["cluster"]["children"]) == {"master", "workers"}
    ws, lap = inv["_meta"]["hostvars"]["workstation"], inv["_meta"]["hostvars"]["laptop"]
    assert (ws["train_interface"], ws["omp_num_threads"], ws["torch_variant"], ws["train_device"]) == (
        "enp4s0", 8, "cu128", "cpu")
    assert (lap["train_interface"], lap["omp_num_threads"]) == ("wlp3s0", 4)
    assert ws["lan_subnet"] == "192.168.1.0/24"


def test_inventory_doc_names_every_variable_the_roles_read() -> None:
    """Each `{{ name | default(...) }}` in a role default is an inventory or extra-var: documented."""
    doc = (ROOT / "docs/INVENTORY.md").read_text()
    names = set()
    for role in ROLES:
        text = (ROLES_DIR / role / "defaults/main.yml").read_text()
        names |= set(re.findall(r"\{\{\s*([a-z_]+)\s*\|\s*default\(", text))
    names -= {"ansible_port"}
    assert names >= {"lan_subnet", "train_interface", "omp_num_threads", "depth", "run_name", "restart"}
    missing = sorted(n for n in names if f"`{n}`" not in doc)
    assert not missing, f"docs/INVENTORY.md does not document {missing}"
    for name in ("nproc_per_node", "torch_variant", "torch_wheelhouse", "train_device"):
        assert f"`{name}`" in doc


# ---- the interface filter ---------------------------------------------------------------------

def _plugin(role: str, name: str):
    path = ROLES_DIR / role / "filter_plugins" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{name}_filter", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _filter():
    return _plugin("cluster_facts", "cluster_facts").cluster_facts_train_net


FACTS = {
    "interfaces": ["lo", "enp4s0", "docker0", "tailscale0", "wlp3s0"],
    "enp4s0": {"ipv4": {"address": "192.168.1.36"}},
    "docker0": {"ipv4": {"address": "172.17.0.1"}},
    "tailscale0": {"ipv4": {"address": "100.64.0.5"}},
    "wlp3s0": {"ipv4": {"address": "10.9.8.7"}, "ipv4_secondaries": [{"address": "192.168.1.99"}]},
    "lo": {"ipv4": {"address": "127.0.0.1"}},
}


def test_filter_uses_the_requested_interface() -> None:
    net = _filter()(FACTS, "192.168.1.0/24", "enp4s0")
    assert net == {"interface": "enp4s0", "ipv4": "192.168.1.36", "error": ""}
    assert _filter()(FACTS, "192.168.1.0/24", "wlp3s0")["ipv4"] == "192.168.1.99"  # secondary address


def test_filter_names_a_missing_interface_and_the_right_one() -> None:
    net = _filter()(FACTS, "192.168.1.0/24", "eth0")
    assert net["interface"] == "" and "'eth0' does not exist" in net["error"]
    assert "enp4s0 has 192.168.1.36" in net["error"]


def test_filter_refuses_an_interface_off_the_lan() -> None:
    net = _filter()(FACTS, "192.168.1.0/24", "docker0")
    assert "no IPv4 address in lan_subnet 192.168.1.0/24" in net["error"] and "172.17.0.1" in net["error"]


def test_filter_derives_the_only_interface_on_the_lan() -> None:
    facts = {k: v for k, v in FACTS.items() if k != "wlp3s0"} | {"interfaces": ["lo", "enp4s0", "docker0"]}
    assert _filter()(facts, "192.168.1.0/24", "")["interface"] == "enp4s0"


def test_filter_asks_when_two_interfaces_are_on_the_lan() -> None:
    net = _filter()(FACTS, "192.168.1.0/24", "")
    assert net["interface"] == "" and "several interfaces" in net["error"]


def test_filter_rejects_a_bad_subnet_and_dashed_names() -> None:
    assert "not an IPv4 network" in _filter()(FACTS, "192.168.1/abc", "")["error"]
    facts = {"interfaces": ["br-lan"], "br_lan": {"ipv4": {"address": "10.0.0.2"}}}
    assert _filter()(facts, "10.0.0.0/8", "br-lan")["ipv4"] == "10.0.0.2"


@pytest.mark.parametrize("subnet", ["192.168.1.0/24", "10.0.0.0/8", "172.16.0.0/12", "172.20.5.0/24", "10.77.1.0/24"])
def test_subnet_check_accepts_private_ranges(subnet: str) -> None:
    assert _plugin("cluster_facts", "cluster_facts").cluster_facts_subnet_problem(subnet) == ""


@pytest.mark.parametrize(
    ("subnet", "expect"),
    [
        ("0.0.0.0/0", "is not inside a private range"),
        ("8.8.8.0/24", "is not inside a private range"),
        ("10.0.0.0/7", "is not inside a private range"),
        ("172.0.0.0/8", "is not inside a private range"),
        ("100.64.0.0/10", "is not inside a private range"),
        ("192.168.1.5", "has no prefix length"),
        ("fd00::/64", "is not an IPv4 network"),
        ("192.168.1/abc", "is not an IPv4 network"),
        ("", "lan_subnet is not set"),
    ],
)
def test_subnet_check_names_the_value_and_the_fix(subnet: str, expect: str) -> None:
    problem = _plugin("cluster_facts", "cluster_facts").cluster_facts_subnet_problem(subnet)
    assert expect in problem and "Fix: set lan_subnet" in problem, problem
    if subnet:
        assert repr(subnet) in problem


PORTS = {"master": 29500, "gloo_min": 40000, "gloo_max": 40999, "mlflow": 5000}


def _ufw_tuple(port: str, source: str, comment: str = "", anywhere: str = "0.0.0.0/0") -> str:
    """A rule line as ufw writes it in /etc/ufw/user.rules (the comment hex-encoded)."""
    return f"### tuple ### allow tcp {port} {anywhere} any {source} in" + (
        f" comment={comment.encode().hex()}" if comment else "")


USER_RULES = "\n".join([
    "*filter",
    _ufw_tuple("22", "0.0.0.0/0", "ssh"),
    _ufw_tuple("29500", "10.77.1.0/24", "nanochat torchrun rendezvous"),  # an earlier version's subnet rule
    _ufw_tuple("40000:40999", "10.77.1.10", "nanochat gloo"),
    _ufw_tuple("40000:40999", "10.77.1.13", "nanochat gloo"),
    _ufw_tuple("5000", "10.77.1.10", "nanochat mlflow"),
    _ufw_tuple("8080", "10.77.1.0/24"),  # a person's rule
])
USER6_RULES = "\n".join([
    _ufw_tuple("22", "::/0", "ssh", "::/0"),
    _ufw_tuple("29500", "fd00::/64", "nanochat torchrun rendezvous", "::/0"),
])


def test_firewall_wants_each_node_address_on_each_port() -> None:
    fw = _plugin("firewall", "firewall")
    rules = fw.firewall_training_rules(["10.77.1.10", "10.77.1.11"], PORTS, [])
    assert [(r["port"], r["from_ip"]) for r in rules] == [
        ("29500", "10.77.1.10"), ("40000:40999", "10.77.1.10"), ("29500", "10.77.1.11"), ("40000:40999", "10.77.1.11")]
    assert {r["comment"] for r in rules} == {"nanochat torchrun rendezvous", "nanochat gloo"}
    master = fw.firewall_training_rules(["10.77.1.10"], PORTS, ["10.77.1.10", "10.77.1.1"])
    assert [(r["port"], r["from_ip"]) for r in master if r["port"] == "5000"] == [("5000", "10.77.1.10"),
                                                                                  ("5000", "10.77.1.1")]


def test_firewall_finds_our_stale_rules_only() -> None:
    """The subnet-wide rule of earlier versions, a removed node, MLflow when not wanted, anything of ours on
    IPv6 are stale; the SSH rule and a person's rule (no 'nanochat ' comment) are not ours."""
    fw = _plugin("firewall", "firewall")
    wanted = fw.firewall_training_rules(["10.77.1.10", "10.77.1.11"], PORTS, [])
    stale = fw.firewall_stale_rules([USER_RULES, USER6_RULES], wanted)
    assert [(r["port"], r["from_ip"]) for r in stale] == [
        ("29500", "10.77.1.0/24"), ("40000:40999", "10.77.1.13"), ("5000", "10.77.1.10"), ("29500", "fd00::/64")]
    assert all(r["rule"] == "allow" and r["proto"] == "tcp" for r in stale)
    current = fw.firewall_training_rules(["10.77.1.10", "10.77.1.13"], PORTS, ["10.77.1.10"])
    kept = fw.firewall_stale_rules([USER_RULES], current)
    assert [(r["port"], r["from_ip"]) for r in kept] == [("29500", "10.77.1.0/24")]


def test_the_preflight_names_every_way_the_training_ports_differ_from_the_nodes() -> None:
    """Missing node rules; the subnet-wide rule of earlier versions, a person's rule to any port, our
    rule on IPv6: each named. Exactly the nodes' rules (and other ports' rules, MLflow's included): none."""
    fw = _plugin("firewall", "firewall")
    wanted = fw.firewall_training_rules(["10.77.1.10", "10.77.1.11"], PORTS, [])
    exact = "\n".join(_ufw_tuple(r["port"], r["from_ip"], r["comment"]) for r in wanted)
    others = "\n".join([_ufw_tuple("22", "0.0.0.0/0", "ssh"), _ufw_tuple("5000", "10.77.1.1", "nanochat mlflow"),
                        _ufw_tuple("8080", "10.77.1.0/24")])
    assert fw.firewall_rule_problems([exact, others, ""], wanted) == []
    anything = "### tuple ### allow any any 0.0.0.0/0 any 192.168.9.9 in"  # `ufw allow from 192.168.9.9`
    problems = fw.firewall_rule_problems([USER_RULES + "\n" + anything, USER6_RULES], wanted)
    assert problems == [
        "no rule allows 29500/tcp from 10.77.1.10",
        "no rule allows 29500/tcp from 10.77.1.11",
        "no rule allows 40000:40999/tcp from 10.77.1.11",
        "a rule allows 29500/tcp from 10.77.1.0/24 (nanochat torchrun rendezvous), which is not a node",
        "a rule allows 40000:40999/tcp from 10.77.1.13 (nanochat gloo), which is not a node",
        "a rule allows any/any from 192.168.9.9, which is not a node",
        "a rule allows 29500/tcp from fd00::/64 (nanochat torchrun rendezvous), which is not a node",
    ], problems
    # a node out of the play, its address unknown here: our single-address rules may be its own
    unknown = fw.firewall_rule_problems([USER_RULES], wanted, some_unknown=True)
    assert "a rule allows 40000:40999/tcp from 10.77.1.13 (nanochat gloo), which is not a node" not in unknown
    assert "a rule allows 29500/tcp from 10.77.1.0/24 (nanochat torchrun rendezvous), which is not a node" in unknown


def test_firewall_refuses_sources_off_the_lan_or_on_ipv6() -> None:
    fw = _plugin("firewall", "firewall")
    assert fw.firewall_source_problems({"node0": "10.77.1.10"}, ["10.77.1.1", "192.168.5.0/24"], "10.77.1.0/24") == []
    problems = fw.firewall_source_problems(
        {"node0": "10.77.1.10", "node1": "", "node2": "10.88.0.2"}, ["fd00::1", "0.0.0.0/0"], "10.77.1.0/24")
    assert problems == [
        "node1: no training address (not in this play, and no node_ipv4 in the inventory)",
        "node2: training address '10.88.0.2' is not an IPv4 address in lan_subnet 10.77.1.0/24",
        "mlflow_clients: 'fd00::1' is not an IPv4 address or a network of /8 or longer",
        "mlflow_clients: '0.0.0.0/0' is not an IPv4 address or a network of /8 or longer",
    ]


# ---- train.yml refuses bad input before any node play --------------------------------------------

# The example inventory's two hosts keep their addresses (the checks read them) but can never be
# reached: ssh's proxy command is `false`, so a play that gets to them fails on this machine, UNREACHABLE,
# without a packet sent to the example's LAN.
LOCALHOST_INV = """all:
  hosts:
    localhost:
      ansible_connection: local
      ansible_python_interpreter: "{{ ansible_playbook_python }}"
    workstation:
      ansible_ssh_common_args: -o ProxyCommand=false
    laptop:
      ansible_ssh_common_args: -o ProxyCommand=false
"""


@pytest.mark.parametrize(
    ("extra", "expect"),
    [
        (["-e", "depth=-3"], "depth=-3 must be a positive integer"),
        (["-e", "train_device=tpu"], "train_device must be cpu or cuda"),
        (["-e", "total_batch_size=1000"], "Nearest valid total_batch_size: 2048 (-e total_batch_size=2048)"),
        (["-e", "total_batch_size=3000", "-e", "device_batch_size=1", "-e", "max_seq_len=256"],
         "Nearest valid total_batch_size: 2560 or 3072"),
        (["-e", "dtype=fp16"], "dtype=fp16 must be one of: auto, float32, bfloat16"),
        (["-e", "work_split=fast"], "work_split=fast must be one of: auto, even, inventory"),
        (["-e", "grad_comm_dtype=int8"], "grad_comm_dtype=int8 must be one of: float32, bfloat16"),
        (["-e", "sync_every=0"], "sync_every=0 must be a positive integer or auto"),
        (["-e", "sync_warmup_ratio=1"], "sync_warmup_ratio=1.0 must be in [0, 1) (with local steps"),
        (["-e", "train_device=cuda"], "train_device=cuda needs torch_variant cuNNN on every node; laptop"),
        (["-e", "lan_subnet=0.0.0.0/0"], "lan_subnet='0.0.0.0/0' is not inside a private range"),
        (["-e", "nproc_per_node=100"], "nproc_per_node=100 must be an integer from 1 to 64"),
        (["-e", "restart=ture"], "restart=ture must be true or false"),
        (["-e", "min_nodes=3"], "min_nodes=3 must be a whole number from 1 to the inventory's 2 node(s)"),
        (["-e", "work_split=inventory", "-e", "min_nodes=1"], "use -e min_nodes=2 with it, or -e work_split=auto"),
        (["-e", "run_start_join_timeout=99999"], "run_start_join_timeout=99999 a number of seconds from 30 to 3600"),
        (["-e", '{"firewall_mlflow_clients": ["10.1.2.3"]}'], "firewall_mlflow_clients is now called mlflow_clients"),
        (["-e", "mlflow_clients=everyone"], "mlflow_clients=everyone must be a list of IPv4 addresses or networks"),
    ],
)
def test_bad_extra_vars_fail_before_any_node_play(tmp_path: Path, extra: list[str], expect: str) -> None:
    """The example inventory's hosts are unreachable here: reaching a node play would show it."""
    (tmp_path / "localhost.yml").write_text(LOCALHOST_INV)
    res = subprocess.run(
        [tool("ansible-playbook"), "-i", "inventory/example", "-i", str(tmp_path / "localhost.yml"), "train.yml",
         *extra],
        cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300,
    )
    out = res.stdout + res.stderr
    assert res.returncode != 0, out
    assert expect in " ".join(out.split()), out
    assert "PLAY [Preflight every node]" not in out, "a node play started after a bad extra-var"
    assert "UNREACHABLE" not in out


@pytest.mark.parametrize("playbook", ["train.yml", "sample.yml", "status.yml", "stop.yml"])
@pytest.mark.parametrize("name", ["../..", "..", "d4/../../etc", "-d4", "*", "d8\n"])
def test_a_run_name_that_is_not_a_name_is_refused_before_any_node_is_touched(tmp_path: Path, playbook: str,
                                                                             name: str) -> None:
    """The name becomes a unit instance and a directory under the runs directory, which root and the
    service user act on: each entry point refuses one that could leave it, on the controller (the
    example inventory's hosts are unreachable here: reaching one would show it). A name with a
    newline after it passed the check once (a regex's $ matches before it), and stop.yml then
    reported success and stopped nothing."""
    (tmp_path / "localhost.yml").write_text(LOCALHOST_INV)
    res = subprocess.run(
        [tool("ansible-playbook"), "-i", "inventory/example", "-i", str(tmp_path / "localhost.yml"), playbook,
         "-e", json.dumps({"run_name": name})],
        cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300,
    )
    out = res.stdout + res.stderr
    assert res.returncode != 0, out
    assert " ".join(f"run_name={name} must be 1-64 letters, digits".split()) in " ".join(out.split()), out
    assert "UNREACHABLE" not in out, out


def run_validate_on_localhost(tmp_path: Path, rows: dict[str, object], *extra: str) -> subprocess.CompletedProcess:
    """Only the run role's validate (no node is contacted), the example inventory plus per-host train_rows."""
    (tmp_path / "localhost.yml").write_text(LOCALHOST_INV)
    (tmp_path / "rows.yml").write_text("all:\n  hosts:\n" + "".join(
        f"    {host}: {{train_rows: {value}}}\n" for host, value in rows.items()))
    (tmp_path / "show.yml").write_text(
        "- hosts: localhost\n  gather_facts: false\n"
        "  tasks:\n    - ansible.builtin.import_role:\n        name: run\n        tasks_from: validate\n"
        "    - ansible.builtin.copy:\n        content: '{{ run_config_train_args | trim }}'\n"
        f"        dest: {tmp_path / 'train_args'}\n        mode: '0644'\n")
    return subprocess.run(
        [tool("ansible-playbook"), "-i", "inventory/example", "-i", str(tmp_path / "localhost.yml"), "-i",
         str(tmp_path / "rows.yml"), str(tmp_path / "show.yml"), *extra],
        cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300,
    )


@pytest.mark.parametrize(
    ("extra", "flag"),
    [
        (["-e", "work_split=auto"], "--rank-batch-sizes auto"),  # measured at start
        (["-e", "work_split=inventory", "-e", "total_batch_size=8192"], "--rank-batch-sizes 3,1"),
        ([], "--rank-batch-sizes auto"),  # the default
        (["-e", "work_split=even"], None),
    ],
)
def test_work_split_reaches_the_trainer_flags(tmp_path: Path, extra: list[str], flag: str | None) -> None:
    # the extra trainer flags must land on the same line as the rest: the env file's TRAIN_ARGS ends
    # at the first line break (a run then trained without its paths: every rank refused
    # --data-dir=data)
    res = run_validate_on_localhost(tmp_path, {"workstation": 3, "laptop": 1}, *extra,
                                  "-e", "train_extra_args='--collective-timeout 60'")
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    args = (tmp_path / "train_args").read_text()
    assert "\n" not in args, repr(args)
    assert args.endswith(" --collective-timeout 60"), repr(args)
    if flag:
        assert flag in args, args
    else:
        assert "--rank-batch-sizes" not in args, args


def test_sync_every_and_the_outer_step_reach_the_trainer_flags(tmp_path: Path) -> None:
    res = run_validate_on_localhost(tmp_path, {}, "-e", "sync_every=auto", "-e", "outer_lr=0.5")
    assert res.returncode == 0, res.stdout + res.stderr
    args = (tmp_path / "train_args").read_text()
    assert ("--sync-every auto --outer-lr 0.5 --outer-momentum 0.0 --outer-overlap auto --outer-compress none "
            "--sync-warmup-ratio 0.05" in args), args
    res = run_validate_on_localhost(tmp_path, {}, "-e", "sync_every=8", "-e", "sync_warmup_ratio=0", "-e",
                                    "outer_overlap=on", "-e", "outer_compress=int8")
    assert res.returncode == 0, res.stdout + res.stderr
    assert ("--sync-every 8 --outer-lr 1.0 --outer-momentum 0.0 --outer-overlap on --outer-compress int8 "
            "--sync-warmup-ratio 0 ") in (tmp_path / "train_args").read_text()
    # nothing to overlap where every step is synchronous: the trainer's check names the extra-var's fix
    res = run_validate_on_localhost(tmp_path, {}, "-e", "sync_every=1", "-e", "outer_overlap=on")
    out = res.stdout + res.stderr
    assert res.returncode != 0, out
    assert "outer_overlap=on overlaps the outer syncs of local steps" in out and "-e outer_overlap=off" in out, out


def test_the_wire_dtypes_reach_the_trainer_flags(tmp_path: Path) -> None:
    """bf16 on the wire unless the run asks for fp32: the benchmarks' setting, half the bytes."""
    res = run_validate_on_localhost(tmp_path, {})
    assert res.returncode == 0, res.stdout + res.stderr
    assert "--grad-comm-dtype bfloat16 --param-comm-dtype bfloat16" in (tmp_path / "train_args").read_text()
    res = run_validate_on_localhost(tmp_path, {}, "-e", "grad_comm_dtype=float32", "-e", "param_comm_dtype=float32")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "--grad-comm-dtype float32 --param-comm-dtype float32" in (tmp_path / "train_args").read_text()


def test_the_packing_reaches_the_trainer_flags(tmp_path: Path) -> None:
    res = run_validate_on_localhost(tmp_path, {})
    assert res.returncode == 0, res.stdout + res.stderr
    assert " --packing bestfit " in (tmp_path / "train_args").read_text()
    res = run_validate_on_localhost(tmp_path, {}, "-e", "packing=stream")
    assert res.returncode == 0, res.stdout + res.stderr
    assert " --packing stream " in (tmp_path / "train_args").read_text()
    res = run_validate_on_localhost(tmp_path, {}, "-e", "packing=crop")
    assert res.returncode != 0 and "must be one of: bestfit, stream, got: crop" in res.stdout, res.stdout


def test_work_split_from_the_inventory_is_checked_per_host(tmp_path: Path) -> None:
    res = run_validate_on_localhost(tmp_path, {"workstation": 3, "laptop": 0}, "-e", "work_split=inventory")
    assert res.returncode != 0
    assert "laptop: train_rows=0 must be an integer from 1 to 1024" in res.stdout
    res = run_validate_on_localhost(tmp_path, {"workstation": 5000, "laptop": 1}, "-e", "work_split=inventory")
    assert res.returncode != 0
    assert "workstation: train_rows=5000 must be an integer from 1 to 1024" in " ".join(res.stdout.split())
    res = run_validate_on_localhost(tmp_path, {"workstation": 3, "laptop": 1}, "-e", "work_split=inventory",
                                  "-e", "total_batch_size=1000", "-e", "max_seq_len=256")
    out = " ".join(res.stdout.split())
    assert res.returncode != 0
    assert "the sum of every rank's train_rows x max_seq_len = 3+1 x 256 = 1024" in out, out
    assert "Nearest valid total_batch_size: 1024 (-e total_batch_size=1024)" in out, out


# ---- the trainer's own check of the flags, on the controller ---------------------------------------

def config_check(*flags: str) -> subprocess.CompletedProcess:
    """`python -m nanochat_cpu.run_args check`, the verdict run_args words, in a Python where torch cannot be
    imported."""
    code = ("import runpy, sys; sys.modules['torch'] = None; "
            "runpy.run_module('nanochat_cpu.run_args', run_name='__main__')")
    return subprocess.run([sys.executable, "-c", code, "check", *flags], cwd=ROOT,
                          env={**env(), "WORLD_SIZE": "2", "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=60)


def test_config_and_run_args_import_no_torch() -> None:
    """The controller has the checkout, not necessarily torch: nanochat_cpu.config and run_args must never need it."""
    res = subprocess.run([sys.executable, "-c", "import sys, nanochat_cpu.config, nanochat_cpu.run_args; "
                          "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"],
                         cwd=ROOT, env={**env(), "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]", res.stdout


def test_config_check_accepts_the_flags_the_trainer_accepts() -> None:
    res = config_check("--depth", "2", "--total-batch-size", "2048")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout) == {"ok": True}


def test_config_check_reports_validate_s_own_message_in_parts() -> None:
    from nanochat_cpu import config

    res = config_check("--total-batch-size", "1000")
    verdict = json.loads(res.stdout)
    with pytest.raises(config.ConfigError) as raised:
        config.validate(config.parse_config(["--total-batch-size", "1000"]), world_size=2)
    assert res.returncode == 2
    assert verdict["message"] == str(raised.value) and str(raised.value) in res.stderr
    assert (verdict["ok"], verdict["field"], verdict["value"], verdict["valid"]) == (False, "total_batch_size", "1000",
                                                                                      [2048])


@pytest.mark.parametrize(
    ("flags", "field", "problem"),
    [
        (["--depth", "eight"], "depth", "must be a positive integer"),
        (["--dtype", "fp16"], "dtype", "must be one of: auto, float32, bfloat16"),
        (["--seed", "-1"], "seed", "must be >= 0"),
        (["--bogus", "1"], "", ""),
    ],
)
def test_config_check_names_the_field_of_a_parser_or_range_problem(flags: list[str], field: str, problem: str) -> None:
    res = config_check(*flags)
    verdict = json.loads(res.stdout)
    assert res.returncode == 2, res.stdout
    assert (verdict["field"], verdict["problem"]) == (field, problem), verdict
    assert verdict["message"] in res.stderr
