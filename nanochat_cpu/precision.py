"""The arithmetic a run computes in: --dtype and --muon-dtype resolved from the requested device
and the ranks' CPUs, and the autocast context the forward passes run under.

The trainer, the benchmark and the doctor all ask these questions; none of them imports the
trainer's orchestration for it. A GPU that happens to be present plays no part: only the device
a run asks for does.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch


def compute_dtype(requested: str, device: str, lacking_bf16: list[str]) -> tuple[torch.dtype, str]:
    """The compute dtype and the reason, from --dtype `requested`, --device and the ranks' CPUs.

    `lacking_bf16` names the ranks (`rank r@host`) whose CPU has no native bf16. On CPU, auto
    chooses bf16 autocast only when that list is empty: without AVX512-BF16 or AMX, bf16 is
    emulated and slower than fp32, and one rule for every rank keeps the ranks' arithmetic alike.
    """
    if requested == "float32":
        return torch.float32, "requested --dtype float32"
    if requested == "bfloat16":
        return torch.bfloat16, "requested --dtype bfloat16"
    if device == "cuda":
        return torch.bfloat16, "auto: --device cuda trains in bf16 autocast"
    if lacking_bf16:
        verb = "lacks" if len(lacking_bf16) == 1 else "lack"
        return torch.float32, (f"auto: fp32 because {', '.join(lacking_bf16)} {verb} native bf16 "
                               f"(avx512_bf16/amx_bf16); bf16 is auto only where every rank's CPU has it")
    return torch.bfloat16, ("auto: every rank's CPU has native bf16 (avx512_bf16/amx_bf16): bf16 autocast, "
                            "fp32 weights and optimizer; --dtype float32 to opt out")


def muon_dtype_for(requested: str, device: str, native_bf16: bool) -> tuple[torch.dtype, str]:
    """--muon-dtype: the dtype of Muon's orthogonalisation, and why; `native_bf16`: this CPU's."""
    if requested == "float32":
        return torch.float32, "requested"
    if requested == "bfloat16":
        return torch.bfloat16, "requested"
    if device == "cuda":
        return torch.bfloat16, "auto: cuda"
    if native_bf16:
        return torch.bfloat16, "auto: CPU has native bf16 (avx512_bf16/amx), bf16 matmuls ~2x fp32"
    return torch.float32, "auto: CPU lacks native bf16"


def autocast_for(device: torch.device, dtype: torch.dtype):
    """The forward passes' context: none in fp32, autocast to `dtype` otherwise."""
    if dtype == torch.float32:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)
