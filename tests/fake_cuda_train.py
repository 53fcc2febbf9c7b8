"""Run the trainer on a machine that *claims* a GPU (like the field reports' workstation)."""

import torch

torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 1

from nanochat_cpu.train import main  # noqa: E402 - the patch must precede the import

main()
