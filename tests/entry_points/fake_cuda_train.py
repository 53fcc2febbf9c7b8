"""Run the trainer on a machine that *claims* a GPU (like the field reports' workstation): named
FAKE_GPU_NAME, its bf16 matmul peak FAKE_GPU_PEAK FLOP/s (the CPU's is measured as always).

FAKE_NATIVE_BF16_RANKS (a comma list of ranks, optional) also sets which ranks' CPUs claim
native bf16, so `--dtype auto` can be tested for CPUs with and without it on any machine.
"""

import os

import torch

torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 1

import nanochat_cpu.perf  # noqa: E402 - the patch must precede the import
import nanochat_cpu.startup  # noqa: E402
import nanochat_cpu.train  # noqa: E402

FAKE_GPU_NAME, FAKE_GPU_PEAK = "Fake GeForce RTX 4070", 29.5e12
torch.cuda.get_device_name = lambda device=None: FAKE_GPU_NAME
measure_cpu = nanochat_cpu.perf.measure_matmul_peak


def measure_matmul_peak(device: torch.device, dtype: torch.dtype, *args, **kwargs) -> float:
    return FAKE_GPU_PEAK if device.type == "cuda" else measure_cpu(device, dtype, *args, **kwargs)


nanochat_cpu.perf.measure_matmul_peak = measure_matmul_peak

if "FAKE_NATIVE_BF16_RANKS" in os.environ:
    native = os.environ["FAKE_NATIVE_BF16_RANKS"].split(",")
    nanochat_cpu.startup.cpu_has_native_bf16 = lambda: os.environ.get("RANK", "0") in native

nanochat_cpu.train.main()
