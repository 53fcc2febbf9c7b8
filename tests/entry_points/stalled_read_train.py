"""The trainer with one rank's read of a shard that never returns, for the fault tests.

    STALL_RANK=1 STALL_AFTER=3 python tests/entry_points/stalled_read_train.py [train flags]

Rank STALL_RANK's loaders read their first STALL_AFTER row groups as usual; the next read blocks
for good, as on a dying disk or a hung network mount (no error, no timeout of its own).
Everything else is the real trainer.
"""

import os
import time

from nanochat_cpu import dataloader, train

_real_read = dataloader.read_texts
_stalls = os.environ.get("RANK", "0") == os.environ["STALL_RANK"]
_left = int(os.environ["STALL_AFTER"])


def stalled_read(data_dir, pair):
    global _left
    if _stalls and _left == 0:
        print(f"FAULT: the read of {pair[0]} row group {pair[1]} never returns", flush=True)
        time.sleep(3600)
    _left -= 1
    return _real_read(data_dir, pair)


dataloader.read_texts = stalled_read
train.main()
