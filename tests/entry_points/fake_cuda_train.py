"""Run the trainer on a machine that *claims* a GPU (like the field reports' workstation).

FAKE_NATIVE_BF16_RANKS (a comma list of ranks, optional) also sets which ranks' CPUs claim
native bf16, so `--dtype auto` can be tested for CPUs with and without it on any machine.
"""

import os

import torch

torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 1

import nanochat_cpu.startup  # noqa: E402 - the patch must precede the import
import nanochat_cpu.train  # noqa: E402

if "FAKE_NATIVE_BF16_RANKS" in os.environ:
    native = os.environ["FAKE_NATIVE_BF16_RANKS"].split(",")
    nanochat_cpu.startup.cpu_has_native_bf16 = lambda: os.environ.get("RANK", "0") in native

nanochat_cpu.train.main()
