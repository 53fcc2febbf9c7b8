"""Hybrid CPUs (performance cores and efficiency cores): which cores a rank's threads run on.

OpenMP splits each of the step's GEMMs into equal parts, one a thread, and the GEMM ends when its
slowest part does: on a CPU with both kinds of core (the user's i9-13900KF has 8 P-cores and 16
E-cores, the i5-12450H 4 and 4) threads spread over all of them leave the P-cores waiting for the
E-cores in every GEMM. Whether that costs more than the E-cores add depends on the model and the
CPU, so it is measured, not assumed.

Linux lists the two kinds of core where a CPU has both (`/sys/devices/cpu_core/cpus` and
`/sys/devices/cpu_atom/cpus`). There, `--hybrid-threads auto` times the rank's forward and backward
at the run's start two ways: as OMP_NUM_THREADS says, on every core the process may use (the rule
that holds on every other CPU), and pinned to the rank's share of the P-cores, one thread a
physical core. It keeps the faster and says so with both figures. A CPU that is not hybrid, a
process whose cores are all of one kind, and `--hybrid-threads off` (the inventory's explicit
`omp_num_threads`) change nothing.

Not measured on a real hybrid CPU: the machines this was built on have one kind of core. The
detection and the choice are tested against a fake sysfs tree and a fake timer, and the pinning
itself on this machine's cores (tests/test_core_types.py).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from .grad_target import clear_gradients
from .perf import cores_of

SYSFS = Path("/sys/devices")
CHOICE_SECONDS = 0.5  # timed per layout and turn, at least, after a warm-up pass: a CPU quota's periods average out
MIN_PASSES = 2
ROUNDS = 2  # turns each layout takes at being timed


def cpu_list(text: str) -> set[int]:
    """The CPUs of a kernel CPU list such as `0-15,32`."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if part:
            low, _, high = part.partition("-")
            cpus.update(range(int(low), int(high or low) + 1))
    return cpus


def describe_cpus(cpus: set[int] | frozenset[int]) -> str:
    """`0-7,16` for {0, ..., 7, 16}: the kernel's own notation."""
    runs: list[str] = []
    for cpu in sorted(cpus):
        if runs and int(runs[-1].split("-")[-1]) == cpu - 1:
            runs[-1] = f"{runs[-1].split('-')[0]}-{cpu}"
        else:
            runs.append(str(cpu))
    return ",".join(runs)


@dataclass(frozen=True)
class ThreadLayout:
    """Where a rank's threads run: `threads` of them on `cpus`."""

    name: str
    cpus: frozenset[int]
    threads: int

    def said(self) -> str:
        return f"{self.name}, {self.threads} thread(s) on CPUs {describe_cpus(self.cpus)}"


@dataclass(frozen=True)
class HybridCpu:
    """The cores of each kind this process may use, P-cores grouped by physical core."""

    performance: tuple[frozenset[int], ...]  # each physical P-core's logical CPUs (SMT siblings)
    efficiency: frozenset[int]

    def said(self) -> str:
        p = frozenset().union(*self.performance)
        return (f"{len(self.performance)} P-core(s) (CPUs {describe_cpus(p)}) and {len(self.efficiency)} "
                f"E-core CPU(s) ({describe_cpus(self.efficiency)})")


def read_cpus(path: Path) -> set[int]:
    try:
        return cpu_list(path.read_text())
    except (OSError, ValueError):
        return set()


def hybrid_cpu(allowed: set[int], sysfs: Path | None = None) -> HybridCpu | None:
    """This process's P-cores and E-cores, or None where it may not use both kinds (a CPU with one
    kind of core, a kernel that does not say, an affinity inside one kind). `sysfs`: SYSFS's stand-in."""
    sysfs = sysfs or SYSFS
    performance = read_cpus(sysfs / "cpu_core" / "cpus") & allowed
    efficiency = read_cpus(sysfs / "cpu_atom" / "cpus") & allowed
    if not performance or not efficiency:
        return None
    return HybridCpu(tuple(cores_of(performance, sysfs / "system" / "cpu")), frozenset(efficiency))


def layouts(cpu: HybridCpu, allowed: set[int], threads_now: int, local_rank: int,
            local_ranks: int) -> list[ThreadLayout]:
    """The ways to time: as configured (every allowed core, OMP_NUM_THREADS threads) first, then
    this rank's share of the P-cores, one thread a physical core (not offered where the host has
    fewer P-cores than ranks)."""
    configured = ThreadLayout("all cores as OMP_NUM_THREADS says", frozenset(allowed), threads_now)
    share = len(cpu.performance) // local_ranks
    if share == 0:
        return [configured]
    mine = cpu.performance[local_rank * share:(local_rank + 1) * share]
    return [configured, ThreadLayout("P-cores only", frozenset().union(*mine), share)]


def pin(layout: ThreadLayout) -> None:
    """Every thread of this process on the layout's CPUs (a thread keeps the affinity it was made
    with, so OpenMP's pool, made long before, would not follow the process's), and the layout's
    number of threads for torch's operators."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), layout.cpus)
        except (ProcessLookupError, FileNotFoundError):
            pass  # a thread that ended meanwhile
    torch.set_num_threads(layout.threads)


def choose_layout(options: list[ThreadLayout],
                  seconds_of: Callable[[], float]) -> tuple[ThreadLayout, list[float]]:
    """Each option pinned and timed (`seconds_of` times passes at the current layout), the faster
    kept and pinned. The options take turns, ROUNDS times, and each keeps its best time: the first
    to be timed pays for what a process does once (allocations, kernels chosen per thread count),
    and a host that gets busier mid-way weighs on every option. A tie keeps the first, the
    configured one."""
    seconds = [float("inf")] * len(options)
    for _ in range(ROUNDS):
        for i, option in enumerate(options):
            pin(option)
            seconds[i] = min(seconds[i], seconds_of())
    best = options[seconds.index(min(seconds))]
    pin(best)
    return best, seconds


def pass_seconds(model, rows: torch.Tensor, ctx) -> float:
    """Mean seconds of the model's forward and backward on `rows` (CPU), after a warm-up pass,
    over at least CHOICE_SECONDS; the gradients it leaves are the caller's to clear."""
    x, y = rows[:, :-1], rows[:, 1:]
    seen: list[float] = []
    while len(seen) < MIN_PASSES + 1 or sum(seen[1:]) < CHOICE_SECONDS:
        t0 = time.perf_counter()
        with ctx:
            model(x, y).backward()
        seen.append(time.perf_counter() - t0)
    return sum(seen[1:]) / (len(seen) - 1)


def choose_threads(model, rows: int, seq_len: int, seed: int, ctx, local_rank: int,
                   local_ranks: int) -> str | None:
    """`--hybrid-threads auto` on the CPU: where this process may use both kinds of core, time a
    forward and backward of `rows` rows both ways (`layouts`), keep the faster pinned, and return
    the line that says so; None elsewhere, with nothing changed."""
    allowed = os.sched_getaffinity(0)
    cpu = hybrid_cpu(allowed)
    if cpu is None:
        return None
    options = layouts(cpu, allowed, torch.get_num_threads(), local_rank, local_ranks)
    if len(options) == 1:
        return (f"hybrid CPU here: {cpu.said()}; fewer P-cores than the host's {local_ranks} ranks, so the threads "
                f"stay as OMP_NUM_THREADS says")
    gen = torch.Generator().manual_seed(seed)  # not the global RNG: training stays reproducible
    batch = torch.randint(0, model.cfg.vocab_size, (rows, seq_len + 1), generator=gen)
    best, seconds = choose_layout(options, lambda: pass_seconds(model, batch, ctx))
    clear_gradients(model.parameters())  # as the optimizer's zero_grad leaves them
    timed = "; ".join(f"{s * 1000:.0f} ms with {o.said()}" for o, s in zip(options, seconds, strict=True))
    return (f"hybrid CPU here: {cpu.said()}. A forward and backward of {rows} row(s) took {timed}: keeping "
            f"{best.name} (threads now {torch.get_num_threads()} on CPUs {describe_cpus(os.sched_getaffinity(0))}; "
            f"a number for omp_num_threads in the inventory, or --hybrid-threads off, keeps OMP_NUM_THREADS)")
