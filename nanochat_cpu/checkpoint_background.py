"""Checkpoints that reach every disk while the inner steps go on.

A checkpoint gives every disk every rank's state, so that a node wiped, added or left alone can
still resume. With local steps that is the whole of each node's optimizer state crossing the
wire, and on a slow link it took as long as several inner steps did (10 Mbit/s, depth 8: 461 s,
against 30-s steps), all of it with every rank waiting. Yet between two outer syncs the wire
carries nothing. So with local steps a checkpoint is taken at once (this rank's state as bytes,
the writer's own copy of the weights: what the inner steps go on to change is not in it) and a
thread of every rank sends, writes and seals it while the loop trains on. Nothing about what is
written changes, only when: the files, the marker and the log line are save_checkpoint's.

What keeps this safe:
- One at a time, and waited for before anything else touches the checkpoints: the next
  checkpoint (its wait is logged), the last step's and a stop's, which are written while every
  rank waits.
- The thread's collectives go on a process group of their own, and its own watchdog names a
  round that stalls (a peer lost mid-way), exiting as the loop's would; a full disk stops every
  rank with its reason, as in the loop.
- No disk seals it, nor prunes an older one, before every disk reported its write: a node lost
  while it crosses leaves it unsealed everywhere, and the run resumes from the checkpoint before.
  (Lost after that agreement, as in a checkpoint every rank waits for, some disks may have
  sealed it: the run resumes from it and the others get it back at start.)

What it does not hide: its traffic shares the wire with an outer sync that comes before it is
done (one that crosses in less than an inner phase never meets one), and a stop or the last
step waits for it before writing its own checkpoint with every rank waiting.
"""

from __future__ import annotations

import dataclasses
import datetime
import threading
import time

import torch.distributed as dist

from .checkpoint import Snapshot, write_checkpoint
from .checkpoint_transfer import Disks
from .dist import EXIT_COLLECTIVE, DistEnv, Watchdog, fail, log


class BackgroundCheckpoints:
    def __init__(self, env: DistEnv, disks: Disks, watchdog: Watchdog, collective_timeout: float):
        """Collective: every rank builds the process group the thread's collectives go on."""
        self.env = env
        with watchdog.phase("new process group for background checkpoints", 0):
            group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=collective_timeout))
        self.disks = dataclasses.replace(disks, group=group)
        self.watchdog = Watchdog(env, watchdog.bound_s)  # a phase of its own: the loop's watchdog keeps the loop's
        self.thread: threading.Thread | None = None
        self.writing: int | None = None  # the step being written
        self.took: tuple[int, float] | None = None  # the last one written: its step and seconds

    def start(self, snap: Snapshot) -> None:
        """Write `snap` while the loop goes on (the one before it first)."""
        self.wait(snap.step)
        log(self.env, f"checkpoint step {snap.step} taken: it reaches every disk in the background while the "
                      f"inner steps go on")
        self.writing = snap.step
        self.thread = threading.Thread(target=self._write, args=(snap, time.perf_counter()),
                                       name=f"checkpoint-{snap.step}", daemon=True)
        self.thread.start()

    def _write(self, snap: Snapshot, t0: float) -> None:
        try:
            self.took = snap.step, write_checkpoint(self.env, self.disks, snap, self.watchdog,
                                                    how=", in the background of the inner steps")
        except BaseException as exc:  # noqa: BLE001 - a thread's error would otherwise only be printed
            fail(self.env, EXIT_COLLECTIVE, f"checkpoint step {snap.step}, written in the background, failed after "
                                            f"{time.perf_counter() - t0:.1f}s: {type(exc).__name__}: {exc}. Exiting "
                                            f"so the unit restarts and resumes from the newest checkpoint "
                                            f"sealed.")

    def wait(self, step: int) -> None:
        """Until the checkpoint being written is on every disk and sealed (bounded: its watchdog)."""
        if self.thread is None:
            return
        t0 = time.perf_counter()
        self.thread.join()
        waited = time.perf_counter() - t0
        if waited >= 0.1:
            log(self.env, f"step {step} waited {waited:.1f}s for checkpoint step {self.writing} to reach every disk")
        self.thread, self.writing = None, None
