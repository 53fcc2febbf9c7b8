"""Hybrid CPUs (nanochat_cpu/core_types.py): the two kinds of core read from a fake sysfs tree,
the layouts a rank times, the choice against a fake timer, the pinning on this machine's real
cores, and a real run on a tree that claims this machine's two CPUs are one P-core and one E-core."""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path

import pytest
import torch

from nanochat_cpu.core_types import ThreadLayout, choose_layout, cpu_list, describe_cpus, hybrid_cpu, layouts, pin
from tests.trainer_runs import ENTRY_POINTS, run_torchrun, tiny_flags

ALLOWED = sorted(os.sched_getaffinity(0))
two_cpus = pytest.mark.skipif(len(ALLOWED) < 2, reason="needs two CPUs to pin one of them")


def fake_sysfs(root: Path, performance: dict[int, int], efficiency: list[int]) -> Path:
    """A /sys/devices of a hybrid CPU: `performance` maps each P-core CPU to its core id (SMT
    siblings share one); each E-core CPU is a core of its own."""
    (root / "cpu_core").mkdir(parents=True)
    (root / "cpu_atom").mkdir()
    (root / "cpu_core" / "cpus").write_text(describe_cpus(set(performance)) + "\n")
    (root / "cpu_atom" / "cpus").write_text(describe_cpus(set(efficiency)) + "\n")
    cores = {**performance, **{cpu: 1000 + cpu for cpu in efficiency}}
    for cpu, core in cores.items():
        topology = root / "system" / "cpu" / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "core_id").write_text(f"{core}\n")
        (topology / "physical_package_id").write_text("0\n")
    return root


def i9_13900kf(root: Path) -> Path:
    """8 P-cores with two threads each (CPUs 0-15, siblings 2k and 2k+1), 16 E-cores (CPUs 16-31)."""
    return fake_sysfs(root, {cpu: cpu // 2 * 4 for cpu in range(16)}, list(range(16, 32)))


def test_cpu_lists_read_and_said_in_the_kernel_notation():
    assert cpu_list("0-15,32\n") == set(range(16)) | {32}
    assert cpu_list("7") == {7} and cpu_list("") == set()
    assert describe_cpus(set(range(16)) | {32, 34, 35}) == "0-15,32,34-35"


def test_an_i9_13900kf_shows_its_two_kinds_of_core_and_each_rank_its_share(tmp_path: Path):
    sysfs, allowed = i9_13900kf(tmp_path), set(range(32))
    cpu = hybrid_cpu(allowed, sysfs)
    assert cpu is not None and len(cpu.performance) == 8 and cpu.performance[1] == {2, 3}
    assert cpu.said() == "8 P-core(s) (CPUs 0-15) and 16 E-core CPU(s) (16-31)"
    configured, p_only = layouts(cpu, allowed, 24, 0, 1)
    assert configured == ThreadLayout("all cores as OMP_NUM_THREADS says", frozenset(allowed), 24)
    assert p_only == ThreadLayout("P-cores only", frozenset(range(16)), 8)  # a thread a physical core
    # two ranks on the host: each its own half of the P-cores
    assert layouts(cpu, allowed, 12, 1, 2)[1] == ThreadLayout("P-cores only", frozenset(range(8, 16)), 4)
    # more ranks than P-cores: nothing to time but the configured layout
    assert layouts(cpu, allowed, 2, 0, 9) == [ThreadLayout("all cores as OMP_NUM_THREADS says", frozenset(allowed), 2)]


def test_the_doctor_says_what_a_nodes_first_rank_would_time(tmp_path: Path, monkeypatch):
    """On an i9-13900KF with two ranks a node, the first rank's half of the P-cores."""
    from nanochat_cpu import core_types, doctor

    monkeypatch.setattr(core_types, "SYSFS", i9_13900kf(tmp_path))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(32)))
    _, facts = doctor.check_device("cpu", nproc_per_node=2)
    said = facts["hybrid_cpu"]
    assert said.startswith("8 P-core(s) (CPUs 0-15) and 16 E-core CPU(s) (16-31); a run's first rank here times all "
                           "cores as OMP_NUM_THREADS says"), said
    assert said.endswith("against P-cores only, 4 thread(s) on CPUs 0-7 and keeps the faster"), said


def test_a_cpu_of_one_kind_or_an_affinity_inside_one_kind_is_not_hybrid(tmp_path: Path):
    sysfs = i9_13900kf(tmp_path / "hybrid")
    assert hybrid_cpu(set(range(16)), sysfs) is None  # pinned to the P-cores already (taskset)
    assert hybrid_cpu(set(range(16, 32)), sysfs) is None
    assert hybrid_cpu(set(range(32)), tmp_path / "no-such-tree") is None  # a kernel or CPU that does not say
    (tmp_path / "one" / "cpu").mkdir(parents=True)  # an AMD or pre-Alder-Lake CPU: no cpu_core/cpu_atom
    assert hybrid_cpu(set(range(32)), tmp_path / "one") is None


def test_without_topology_each_p_core_cpu_is_a_core_of_its_own(tmp_path: Path):
    (tmp_path / "cpu_core").mkdir()
    (tmp_path / "cpu_atom").mkdir()
    (tmp_path / "cpu_core" / "cpus").write_text("0-3")
    (tmp_path / "cpu_atom" / "cpus").write_text("4-7")
    cpu = hybrid_cpu(set(range(8)), tmp_path)
    assert cpu is not None and [sorted(c) for c in cpu.performance] == [[0], [1], [2], [3]]


def task_cpus() -> dict[int, str]:
    """Every thread of this process: its Cpus_allowed_list, as the kernel holds it."""
    found = {}
    for tid in os.listdir("/proc/self/task"):
        status = Path(f"/proc/self/task/{tid}/status").read_text()
        found[int(tid)] = re.search(r"Cpus_allowed_list:\s*(\S+)", status).group(1)
    return found


@two_cpus
def test_the_faster_layout_is_kept_and_every_thread_of_the_process_pinned_to_it():
    threads_before = torch.get_num_threads()
    configured = ThreadLayout("all", frozenset(ALLOWED), 2)
    one = ThreadLayout("one", frozenset(ALLOWED[:1]), 1)
    started, done = threading.Event(), threading.Event()

    def bystander() -> None:  # a thread made before the choice, as OpenMP's pool and the loaders are
        started.set()
        done.wait(30)

    helper = threading.Thread(target=bystander, daemon=True)
    helper.start()
    started.wait(10)
    try:
        # the fake timer: whatever runs on one CPU is faster
        best, seconds = choose_layout([configured, one], lambda: 0.5 if len(os.sched_getaffinity(0)) == 1 else 1.0)
        assert best == one and seconds == [1.0, 0.5]  # each its best of two turns
        assert set(task_cpus().values()) == {str(ALLOWED[0])}, task_cpus()  # the bystander too
        assert torch.get_num_threads() == 1
        # a tie keeps the configured layout, and pins it back
        best, _ = choose_layout([configured, one], lambda: 1.0)
        assert best == configured and set(task_cpus().values()) == {describe_cpus(set(ALLOWED))}
        assert torch.get_num_threads() == 2
    finally:
        done.set()
        pin(ThreadLayout("restore", frozenset(ALLOWED), threads_before))


@two_cpus
def test_a_run_on_a_hybrid_cpu_times_both_layouts_and_trains_on_the_one_it_keeps(tiny_data_dir, tiny_tokenizer_dir,
                                                                                tmp_path: Path):
    """The trainer, told by a fake tree that CPU a is a P-core and CPU b an E-core, times a forward
    and backward both ways on the real cores, keeps the faster, and says so with both figures and
    the affinity it then has (sched_getaffinity); the run ends well. With --hybrid-threads off it
    times nothing."""
    p, e = ALLOWED[0], ALLOWED[1]
    sysfs = fake_sysfs(tmp_path / "sysfs", {p: 0}, [e])
    flags = tiny_flags(tiny_data_dir, tiny_tokenizer_dir, tmp_path / "run", num_iterations=2, checkpoint_every=0)
    proc = run_torchrun(1, [str(ENTRY_POINTS / "fake_hybrid_train.py"), *flags],
                        env_extra={"FAKE_SYSFS": str(sysfs), "OMP_NUM_THREADS": "2"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    said = re.search(
        rf"hybrid CPU here: 1 P-core\(s\) \(CPUs {p}\) and 1 E-core CPU\(s\) \({e}\)\. A forward and backward of "
        rf"\d+ row\(s\) took (\d+) ms with all cores as OMP_NUM_THREADS says, 2 thread\(s\) on CPUs "
        rf"{re.escape(describe_cpus(set(ALLOWED)))}; (\d+) ms with P-cores only, 1 thread\(s\) on CPUs {p}: keeping "
        r"(all cores as OMP_NUM_THREADS says|P-cores only) \(threads now (\d+) on CPUs ([0-9,-]+);", out)
    assert said, out
    print(said.group(0))
    configured_ms, p_only_ms, kept, threads, cpus = said.groups()
    assert kept == ("P-cores only" if int(p_only_ms) < int(configured_ms) else "all cores as OMP_NUM_THREADS says") \
        or abs(int(p_only_ms) - int(configured_ms)) <= 1  # the figures are rounded to the ms
    expected = (1, str(p)) if kept == "P-cores only" else (2, describe_cpus(set(ALLOWED)))
    assert (int(threads), cpus) == expected, said.group(0)
    off = run_torchrun(1, [str(ENTRY_POINTS / "fake_hybrid_train.py"), *flags, "--hybrid-threads", "off",
                           "--out-dir", str(tmp_path / "off")],
                       env_extra={"FAKE_SYSFS": str(sysfs), "OMP_NUM_THREADS": "2"})
    assert off.returncode == 0 and "hybrid CPU here" not in off.stdout + off.stderr, off.stdout + off.stderr
