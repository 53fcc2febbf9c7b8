"""The cluster fault cases: inject faults into a converged 3-node cluster and check what happens.

    molecule converge -s faults
    pytest molecule/faults -v [-k drift] [--inventory molecule/faults/inventory]

Each test_*.py module is one case; its CASE names it, and `-k CASE` selects it (`-k node-loss`,
`-k drift`, ...). The cases run in the order of CASES whatever pytest collects first. The root
`pytest` does not collect them (testpaths = tests): they need the cluster and root.

Every case merges its measurements into --report (build/molecule-faults.json, from which
docs/FAULTS.md is written) under its name, with `case_s` when it passed or `failed` when not.
FAULTS_EVENTS picks the node-loss faults (test_node_loss.py).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from nodes import REPO, Cluster, log

HERE = Path(__file__).resolve().parent
# drift copies an env file of node-loss's run and inputs resumes node-loss's finished run: node-loss first
CASES = ("node-loss", "absent-start", "drift", "network", "stale", "checkpoint", "inputs")
# module name -> (test, what failed) of the first failure in that case's module
FAILURES: dict[str, tuple[str, str]] = {}


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("faults", "cluster fault cases")
    group.addoption("--inventory", type=Path, default=HERE / "inventory",
                    help="the converged scenario's inventory dir (default: the faults scenario's)")
    group.addoption("--report", type=Path, default=REPO / "build" / "molecule-faults.json",
                    help="JSON file the measurements are merged into (default: build/molecule-faults.json)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "incremental: the module's tests are steps of one run: "
                                       "after a failure the later ones are skipped")


def case_of(item: pytest.Item) -> str | None:
    return getattr(item.module, "CASE", None) if isinstance(item, pytest.Function) else None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if (case := case_of(item)) is not None:
            item.extra_keyword_matches.add(case)  # `-k node-loss` as well as `-k node_loss`
    # stable: a module's tests keep their order, which is the order of the steps of its run
    items.sort(key=lambda item: CASES.index(case) + 1 if (case := case_of(item)) else 0)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    rep = yield
    if rep.failed and case_of(item) is not None:
        what = call.excinfo.exconly() if call.excinfo else rep.longreprtext
        FAILURES.setdefault(item.module.__name__, (item.name, what))
        cluster = item.funcargs.get("cluster") if call.when == "call" else None
        if isinstance(cluster, Cluster):  # a red run explains itself: where every unit stood then
            rep.sections.append(("the nodes when it failed", nodes_state(cluster)))
    return rep


def nodes_state(cluster: Cluster) -> str:
    """Every node's trainer units and their last journal lines, to the microsecond: a wait that ran
    out shows what came before its start as well as after."""
    cmd = ("systemctl list-units 'nanochat-*' --all --no-legend --no-pager; "
           "journalctl -u 'nanochat-train@*' -o short-precise --no-pager -n 40")
    return "\n".join(f"---- {n} (now {time.time():.3f}):\n{cluster.sh(n, cmd, check=False)}" for n in cluster.nodes)


def pytest_runtest_setup(item: pytest.Item) -> None:
    failed = FAILURES.get(item.module.__name__) if case_of(item) else None
    if failed and item.get_closest_marker("incremental"):
        pytest.skip(f"{case_of(item)}: {failed[0]} failed, and this test goes on from where it stopped")


# ---- fixtures -----------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def cluster(pytestconfig: pytest.Config) -> Cluster:
    inventory = pytestconfig.getoption("inventory")
    if not (inventory / "hosts.yml").exists():
        pytest.fail(f"no {inventory}/hosts.yml: converge a scenario first (molecule converge -s faults) "
                    "or pass its --inventory", pytrace=False)
    return Cluster(inventory)


@pytest.fixture(scope="session")
def report(pytestconfig: pytest.Config) -> dict:
    """Every case's measurements: the report file's, each case replaced when it runs again."""
    path = pytestconfig.getoption("report")
    return json.loads(path.read_text()) if path.exists() else {}


@pytest.fixture(scope="module", autouse=True)
def case_report(request: pytest.FixtureRequest, pytestconfig: pytest.Config, report: dict) -> Iterator[dict]:
    """This case's measurements (this attempt's only), written to the report when the case ends."""
    case = request.module.CASE
    report[case] = {}
    t0 = time.time()
    log(f"case {case}")
    yield report[case]
    failed = FAILURES.get(request.module.__name__)
    if failed:
        report[case]["failed"] = failed[1][:2000]
    else:
        report[case]["case_s"] = round(time.time() - t0, 1)
        log(f"case {case} passed in {time.time() - t0:.0f}s")
    path = pytestconfig.getoption("report")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    if FAILURES or terminalreporter.stats.get("passed"):
        terminalreporter.write_line(f"fault measurements: {config.getoption('report')}")
