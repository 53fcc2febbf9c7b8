"""Where the run stands, as a file beside its checkpoints: what status.yml and train.yml's follow read.

Each disk's writer (the master's disk: rank 0) keeps `<out_dir>/status.json` (STATUS_FILE),
replaced whole after every step (a temporary file renamed over it), so a reader never sees half
of one. It says where the run stands as that node sees it: the master's holds the run's loss, its
latest val bpb, the speed verdict and the latest sample; another node's holds the loss of its own
ranks' batch. `state` is `starting` from the set-up to the first step, then `training`, and
`done` or `stopped` at the end; a run that failed keeps its last one, and its unit says failed. A
resumed run starts from the file it left, so its last step, val bpb and verdict stay in view. The
journal's lines stay as they are, for people: no tool parses them.

The file's keys are its contract with roles/run/library/run_progress.py, which reads them; a key
is added, never renamed (`version` says which). The file is written by a thread of its own, the
newest state at a time: a disk that stops answering holds that thread, never a step (the
checkpoint's watchdog names such a disk), and a full one is the checkpoint's to report.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from typing import Any

from .dist import DistEnv, log

STATUS_FILE = "status.json"
VERSION = 1
KEPT_ON_RESUME = ("step", "loss", "tok_per_s", "mfu", "elapsed_s", "eta_s", "elapsed", "eta", "val_bpb", "val_step",
                  "verdict", "sample", "mlflow_charts")


def out_of_the_group(earlier: dict, nodes: list[int] | None) -> dict[str, dict]:
    """The `left` field of a group that has just (re)formed: every inventory place the earlier file
    listed as left or had in its group, less the places in this group, each with the earlier
    step and time it was last seen in (kept from the first time it was found gone)."""
    if not nodes:
        return {}
    left = {place: seen for place, seen in (earlier.get("left") or {}).items() if isinstance(seen, dict)}
    for place in earlier.get("nodes") or []:
        left.setdefault(str(place), {"step": earlier.get("step"), "time": earlier.get("updated")})
    return {place: seen for place, seen in left.items() if not (place.isdigit() and int(place) in nodes)}


class RunStatus:
    def __init__(self, out_dir: str, run_name: str, env: DistEnv, total: int, writes: bool, resumed: bool):
        """`writes`: this rank is its disk's writer; `resumed`: the run goes on from a checkpoint,
        so what the file said of it before stays until this process has newer."""
        self.env = env
        self.path = os.path.join(out_dir, STATUS_FILE) if writes else None
        self.fields: dict[str, Any] = {
            "version": VERSION, "run": run_name, "host": env.host, "rank": env.rank,
            "world_size": env.world_size, "members": sorted(set(env.hosts or [env.host])),
            # an elastic launch: the inventory places (NODE_RANK) of the nodes in the group now
            "nodes": sorted(set(env.nodes)) or None,
            "state": "starting", "step": None, "total": total,
            # the run's loss on the master; elsewhere the loss of this node's ranks' batch
            "loss": None, "loss_of": "run" if env.master else "this node's ranks",
            "tok_per_s": None, "mfu": None, "step_s": None, "elapsed_s": None, "eta_s": None, "elapsed": None,
            "eta": None,
            "val_bpb": None, "val_step": None, "verdict": None, "sample": None, "updated": None,
            # the link to the run's charts in MLflow (rank 0's, once its store started the run)
            "mlflow_charts": None,
            # this node's CUDA GPU that a CPU run leaves idle, with both measured peaks (or None)
            "gpu_note": None,
            # an elastic launch: the inventory places out of the group now that were in it, each
            # with the step and time of the last status written while it was ({"2": {"step": 48, ...}})
            "left": {},
        }
        if self.path is not None and resumed:
            earlier = self._earlier(run_name)
            self.fields.update({k: v for k, v in earlier.items() if k in KEPT_ON_RESUME})
            self.fields["left"] = out_of_the_group(earlier, self.fields["nodes"])
        self.failed_once = False
        self._cond = threading.Condition()
        self._pending: dict[str, Any] | None = None  # the newest state not yet written
        self._writing = False
        self._thread: threading.Thread | None = None

    def _earlier(self, run_name: str) -> dict:
        try:
            with open(self.path) as f:
                earlier = json.load(f)
        except (OSError, ValueError):
            return {}
        return earlier if isinstance(earlier, dict) and earlier.get("run") == run_name else {}

    def update(self, **fields: Any) -> None:
        """Set `fields`; the writer thread writes the file (on a disk's writer) without the caller waiting."""
        unknown = set(fields) - set(self.fields)
        if unknown:  # a typo here would be a key no reader knows
            raise KeyError(f"not a status field: {sorted(unknown)}")
        self.fields.update(fields, updated=round(time.time(), 3))
        if self.path is None:
            return
        with self._cond:
            self._pending = dict(self.fields)
            self._cond.notify_all()
        if self._thread is None:
            self._thread = threading.Thread(target=self._writer, name="status-file", daemon=True)
            self._thread.start()

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait, at most `timeout_s`, for the newest state to reach the file (the run's last)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._pending is not None or self._writing:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def _writer(self) -> None:
        while True:
            with self._cond:
                while self._pending is None:
                    self._cond.wait()
                fields, self._pending, self._writing = self._pending, None, True
            self._write(fields)
            with self._cond:
                self._writing = False
                self._cond.notify_all()

    def _write(self, fields: dict[str, Any]) -> None:
        tmp = f"{self.path}.tmp.{os.getpid()}"
        try:
            with open(tmp, "w") as f:
                json.dump(fields, f)
            os.replace(tmp, self.path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            if not self.failed_once:  # said once: the next step would say it again
                self.failed_once = True
                log(self.env, f"cannot write {self.path} ({exc}); status.yml shows this node's last step "
                              f"written; training goes on")
