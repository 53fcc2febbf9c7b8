"""Run the trainer on a machine that *claims* two kinds of core: the sysfs tree at FAKE_SYSFS (its
`cpu_core/cpus`, `cpu_atom/cpus` and `system/cpu/cpuN/topology/`) stands for /sys/devices, so
`--hybrid-threads auto` finds a hybrid CPU, times both ways on this machine's real cores, and pins
the rank to the one it keeps."""

import os
from pathlib import Path

import nanochat_cpu.core_types
import nanochat_cpu.train

nanochat_cpu.core_types.SYSFS = Path(os.environ["FAKE_SYSFS"])

if __name__ == "__main__":
    nanochat_cpu.train.main()
