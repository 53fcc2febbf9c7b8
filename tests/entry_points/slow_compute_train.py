"""The trainer with every step's compute made longer, for auto's warm-up (tests/test_local_steps.py).

    SLOW_S=1 SLOW_RANK=1 [SLOW_BUSY=1] [SLOW_FROM=4 EARLY_RANK=0 EARLY_S=0.5] [WIRE_S=0.1] [OUTER_WIRE_S=2] \
        python tests/entry_points/slow_compute_train.py [flags]

Rank SLOW_RANK's steps (from step SLOW_FROM on, default the first) sleep SLOW_S seconds before their
forward and backward (with SLOW_BUSY=1 they spin, as compute takes CPU); before SLOW_FROM rank
EARLY_RANK's sleep EARLY_S (none by default), so two ranks can swap speeds mid-run. A tiny model on
loopback computes in milliseconds, so the wire's share of its synchronous step is whatever the
machine's load makes it; a longer compute makes the slow rank's share small for certain, as a big
model's step on a fast link does, while the other ranks wait for it. With WIRE_S every synchronous
step (the optimizer over all ranks; a node's own inner steps are not slowed) waits WIRE_S seconds
more in its collectives, as on a slow link; with OUTER_WIRE_S every outer sync's exchange does (also
one crossing in the background), asleep, as on a slow link, not busy. Everything else is the real
trainer.
"""

import inspect
import os
import time

from nanochat_cpu import sync_diloco, train

_real_accumulate = train.accumulate_gradients


_slow = os.environ.get("RANK") == os.environ["SLOW_RANK"]
_from = int(os.environ.get("SLOW_FROM", "1"))
_signature = inspect.signature(_real_accumulate)


def slow_accumulate(*args, **kwargs):
    done = _signature.bind(*args, **kwargs).arguments["step"]  # this computes done + 1
    if done + 1 < _from and os.environ.get("RANK") == os.environ.get("EARLY_RANK"):
        time.sleep(float(os.environ["EARLY_S"]))
    elif done + 1 >= _from and _slow and os.environ.get("SLOW_BUSY") == "1":
        end = time.perf_counter() + float(os.environ["SLOW_S"])
        while time.perf_counter() < end:
            pass
    elif done + 1 >= _from and _slow:
        time.sleep(float(os.environ["SLOW_S"]))
    return _real_accumulate(*args, **kwargs)


train.accumulate_gradients = slow_accumulate

_real_step = train.MuonAdamW.step
_wire_s = float(os.environ.get("WIRE_S", "0"))


def slow_wire_step(self) -> None:
    _real_step(self)
    if self.group is None and self.world_size > 1:  # every rank steps together: the wire between nodes
        time.sleep(_wire_s)
        self.sync.comm_wait += _wire_s


if _wire_s:
    train.MuonAdamW.step = slow_wire_step

_real_exchange = sync_diloco.DiLoCo._exchange
_outer_wire_s = float(os.environ.get("OUTER_WIRE_S", "0"))


def slow_exchange(self, group, exact=False):
    norm_sq, waited = _real_exchange(self, group, exact)
    time.sleep(_outer_wire_s)
    return norm_sq, waited + _outer_wire_s


if _outer_wire_s:
    sync_diloco.DiLoCo._exchange = slow_exchange
train.main()
