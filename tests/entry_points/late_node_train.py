"""The trainer with one rank late to its first outer sync, for auto's H (tests/test_local_steps.py).

    LATE_RANK=1 LATE_S=3 python tests/entry_points/late_node_train.py [train flags]

Rank LATE_RANK sleeps LATE_S seconds before its first outer sync, as a node whose inner phase
ran long would arrive: the nodes already there wait for it inside the sync, on no wire. Everything
else is the real trainer.
"""

import os
import time

from nanochat_cpu.sync_diloco import DiLoCo

_real_outer_step = DiLoCo.outer_step
_late = os.environ.get("RANK") == os.environ["LATE_RANK"]


def late_outer_step(self: DiLoCo, mean_step_s: float, *args):
    if _late and self.outer_steps == 0:
        print(f"LATE: rank {os.environ['RANK']} sleeps {os.environ['LATE_S']} s before its first outer sync",
              flush=True)
        time.sleep(float(os.environ["LATE_S"]))
    return _real_outer_step(self, mean_step_s, *args)


DiLoCo.outer_step = late_outer_step

from nanochat_cpu.train import main  # noqa: E402 - the patch must precede the import

main()
