"""Hardware facts the trainer reports: matmul peak, native bf16, peak memory, threads.

MFU is only honest against a peak measured on the machine at hand with the thread count the
run actually uses, so the peak is measured (a few hundred ms of large matmuls), not looked up.
"""

from __future__ import annotations

import os
import resource
import time

import torch


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_has_native_bf16() -> bool:
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def measure_matmul_peak(device: torch.device, dtype: torch.dtype, seconds: float = 0.4, n: int = 1024) -> float:
    """Sustained FLOP/s of square matmuls, the ceiling MFU is measured against."""
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


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_rss_mib() -> float:
    # ru_maxrss is in KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def physical_cores() -> int:
    """Physical cores (not SMT siblings) available to this process."""
    allowed = os.sched_getaffinity(0)
    seen = set()
    for cpu in allowed:
        path = f"/sys/devices/system/cpu/cpu{cpu}/topology/core_id"
        pkg = f"/sys/devices/system/cpu/cpu{cpu}/topology/physical_package_id"
        try:
            with open(path) as f, open(pkg) as g:
                seen.add((g.read().strip(), f.read().strip()))
        except OSError:
            seen.add(("?", str(cpu)))
    return max(1, len(seen))
