"""Where the run stands, as a file beside its checkpoints: what status.yml and train.yml's follow read.

Each node's first rank keeps `<out_dir>/status.json` (STATUS_FILE), replaced whole after every
step (a temporary file renamed over it), so a reader never sees half of one. It says where the run
stands as that node sees it: the master's (rank 0's) holds the run's loss, its latest val bpb,
the speed verdict and the latest sample; another node's holds the loss of its own ranks' batch.
The journal's lines stay as they are, for people: no tool parses them.

The file's keys are its contract with roles/run/library/run_progress.py, which reads them; a key
is added, never renamed (`version` says which). Writing it never stops a run: a full disk is the
checkpoint's to report, with its fix.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Any

from .dist import DistEnv, log

STATUS_FILE = "status.json"
VERSION = 1


class RunStatus:
    def __init__(self, out_dir: str, run_name: str, env: DistEnv, total: int):
        self.env = env
        self.path = os.path.join(out_dir, STATUS_FILE) if env.local_rank == 0 else None  # one writer a node
        self.failed_once = False
        self.fields: dict[str, Any] = {
            "version": VERSION, "run": run_name, "host": env.host, "rank": env.rank,
            "world_size": env.world_size, "members": sorted(set(env.hosts or [env.host])),
            "state": "training", "step": None, "total": total,
            # the run's loss on the master; elsewhere the loss of this node's ranks' batch
            "loss": None, "loss_of": "run" if env.master else "this node's ranks",
            "tok_per_s": None, "mfu": None, "elapsed_s": None, "eta_s": None, "elapsed": None, "eta": None,
            "val_bpb": None, "val_step": None, "verdict": None, "sample": None, "updated": None,
        }

    def update(self, **fields: Any) -> None:
        """Set `fields` and write the file (on a node's first rank)."""
        unknown = set(fields) - set(self.fields)
        if unknown:  # a typo here would be a key no reader knows
            raise KeyError(f"not a status field: {sorted(unknown)}")
        self.fields.update(fields, updated=round(time.time(), 3))
        if self.path is not None:
            self._write()

    def _write(self) -> None:
        tmp = f"{self.path}.tmp.{os.getpid()}"
        try:
            with open(tmp, "w") as f:
                json.dump(self.fields, f)
            os.replace(tmp, self.path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            if not self.failed_once:  # said once: the next step would say it again
                self.failed_once = True
                log(self.env, f"cannot write {self.path} ({exc}); status.yml shows this node's last step "
                              f"written; training goes on")
