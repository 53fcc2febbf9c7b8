"""The trainer with its checkpoint exchange slowed down as a slow link would, for the fault tests.

    CHUNK_BYTES=8192 ROUND_S=0.6 python tests/entry_points/slow_checkpoint_train.py [train flags]

Checkpoint states cross between ranks in rounds of CHUNK_BYTES (the real default is 16 MiB), and
each round takes ROUND_S seconds longer than loopback makes it: a checkpoint of a few hundred KiB
then takes as long to cross as a big model's does at 10 Mbit/s. Everything else, the rounds'
collectives included, is the real trainer.
"""

import os
import time

from nanochat_cpu import checkpoint_transfer, train

checkpoint_transfer.CHUNK_BYTES = int(os.environ["CHUNK_BYTES"])
_real_chunk = checkpoint_transfer.exchange_chunk
_round_s = float(os.environ["ROUND_S"])


def slow_chunk(*args, **kwargs) -> None:
    _real_chunk(*args, **kwargs)
    time.sleep(_round_s)


checkpoint_transfer.exchange_chunk = slow_chunk
train.main()
