"""Hardware facts the trainer reports: matmul peak, native bf16, peak memory, threads.

MFU is only honest against a peak measured on the machine at hand with the thread count the
run actually uses, so the peak is measured (a few hundred ms of large matmuls), not looked up.
"""

from __future__ import annotations

import ctypes
import functools
import os
import resource
import time
from pathlib import Path

import torch


@functools.cache  # read once per process: the trainer, its dtype choices, the doctor and bench all ask
def _cpuinfo() -> dict[str, str]:
    """The first CPU's fields in /proc/cpuinfo (empty where it cannot be read)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block ends
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_flags() -> set[str]:
    return set(_cpuinfo().get("flags", "").split())


def kernels_capped_below_cpu() -> str | None:
    """The vector ISA torch's kernels were capped at, where that is below the CPU's own, else None.

    `ATEN_CPU_CAPABILITY=avx2` (with `ONEDNN_MAX_CPU_ISA=AVX2` for oneDNN's) runs an AVX-512
    CPU's kernels as an AVX2-only CPU runs them: the way to rehearse the user's i9/i5 class on
    another machine. Figures from such a run must say so, and nothing may count on bf16 there."""
    kernels = torch.backends.cpu.get_cpu_capability()
    return kernels if "avx512f" in cpu_flags() and not kernels.startswith("AVX512") else None


def cpu_model() -> str:
    """The CPU's model name and the vector extensions that decide its speed, e.g. `AMD EPYC
    (avx2; no avx512, no amx)`: benchmark figures name the machine they come from."""
    name = _cpuinfo().get("model name", "unknown CPU")
    flags = cpu_flags()
    have = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    lack = [f for f, prefix in (("avx512", "avx512f"), ("amx", "amx_")) if not any(x.startswith(prefix) for x in flags)]
    capped = kernels_capped_below_cpu()
    return (f"{name} ({', '.join(have) or 'no avx2'}{'; no ' + ', no '.join(lack) if lack else ''})"
            + (f", torch's kernels capped at {capped} (ATEN_CPU_CAPABILITY)" if capped else ""))


def cpu_has_native_bf16() -> bool:
    flags = cpu_flags()
    return ("avx512_bf16" in flags or "amx_bf16" in flags) and kernels_capped_below_cpu() is None


# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4


def reuse_freed_memory() -> str:
    """Keep large freed blocks in the heap instead of handing them back to the kernel.

    glibc serves every allocation above 32 MiB with its own mmap and unmaps it on free, so each
    step's fresh 128-MB logits (depth 4, 1,024 tokens) and embedding gradients arrive as untouched
    pages and fault in one 4-KiB page at a time: measured 86 ms for the LM head's first GEMM into a
    new buffer against 54 ms into a reused one, and 15-20% of a depth-4 step. With mmap off and
    trimming raised, the same blocks are reused from step to step (peak RSS +60 MB at depth 4).
    Returns what was done, for the banner.
    """
    try:  # the interpreter's own symbols include its C library's (no library search, no subprocess)
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return "default allocator (no glibc mallopt)"
    if not (mallopt(_M_MMAP_MAX, 0) and mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)):
        return "default allocator (mallopt refused)"
    return "glibc keeps freed blocks for reuse (M_MMAP_MAX=0)"


def measure_matmul_peak(device: torch.device, dtype: torch.dtype, seconds: float = 0.4, n: int | None = None,
                        ) -> float:
    """Sustained FLOP/s of square matmuls, the ceiling MFU is measured against (a GPU needs larger
    ones than a CPU to be busy rather than waiting on kernel launches)."""
    n = n or (4096 if device.type == "cuda" else 1024)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):
        a @ b  # warm up kernels and caches
    sync(device)
    iters, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        iters += 1
        if device.type == "cuda" and iters % 50 == 0:
            sync(device)
    sync(device)
    return 2 * n**3 * iters / (time.perf_counter() - t0)


def unused_gpu(device: torch.device) -> tuple[str, float] | None:
    """A CUDA GPU of this host that a CPU run leaves idle: its name and bf16 matmul peak in FLOP/s
    (what it would train with). None where the run is on the GPU or torch sees none."""
    if device.type != "cpu" or not torch.cuda.is_available():
        return None
    gpu = torch.device("cuda", 0)
    return torch.cuda.get_device_name(gpu), measure_matmul_peak(gpu, torch.bfloat16)


def sync(device: torch.device) -> None:
    """Wait for the work queued on the device's compute stream (CUDA; a CPU runs it in place).
    Not the whole device: collectives running on NCCL's own streams are joined by Work.wait()."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def peak_rss_mib() -> float:
    # ru_maxrss is in KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def available_memory_mib() -> float | None:
    """Memory this process could still take: the kernel's MemAvailable, or less where the cgroup
    (a systemd unit's MemoryMax) leaves less. None where neither can be read."""
    free = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    free = int(line.split()[1]) / 1024
    except (OSError, ValueError):
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f, open("/sys/fs/cgroup/memory.current") as g:
            limit = f.read().strip()
            if limit != "max":
                left = (int(limit) - int(g.read())) / 2**20
                free = left if free is None else min(free, left)
    except (OSError, ValueError):
        pass
    return free


def cores_of(cpus: set[int], cpu_dir: Path = Path("/sys/devices/system/cpu")) -> list[frozenset[int]]:
    """`cpus` grouped by physical core (SMT siblings together, by package and core id), ordered by
    their first CPU; a CPU whose topology the kernel does not show is a core of its own."""
    cores: dict[tuple[str, str], set[int]] = {}
    for cpu in sorted(cpus):
        topology = cpu_dir / f"cpu{cpu}" / "topology"
        try:
            key = ((topology / "physical_package_id").read_text().strip(), (topology / "core_id").read_text().strip())
        except OSError:
            key = ("?", str(cpu))
        cores.setdefault(key, set()).add(cpu)
    return sorted((frozenset(c) for c in cores.values()), key=min)


def physical_cores() -> int:
    """Physical cores (not SMT siblings) available to this process."""
    return max(1, len(cores_of(os.sched_getaffinity(0))))
