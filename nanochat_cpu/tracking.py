"""MLflow logging from rank 0, that never takes the run down with it.

Default store: sqlite under `--out-dir` (MLflow's file store is in maintenance mode). With a
tracking server (`--tracking-uri http://master:5000`) the curves of every run land in one UI.
If the tracking backend fails mid-run, training goes on and the failure is logged once:
losing curves is bad, losing the run is worse. A resumed run keeps logging to the same MLflow
run (its id is stored in the checkpoints).
"""

from __future__ import annotations

import os
import time
from typing import Any

from .config import TrainConfig
from .dist import DistEnv, log

EXPERIMENT = "nanochat_cpu"
FLUSH_SECONDS = 10.0  # metrics are batched: one sqlite/HTTP write per flush, not per step


def default_tracking_uri(out_dir: str) -> str:
    return "sqlite:///" + os.path.abspath(os.path.join(out_dir, "mlflow.db"))


class Tracker:
    def __init__(self, cfg: TrainConfig, env: DistEnv, resume_run_id: str | None):
        self.env = env
        self.run_id: str | None = None
        self._mlflow: Any = None
        self._pending: list[Any] = []
        self._last_flush = time.monotonic()
        self.enabled = env.master and cfg.tracking_uri.lower() != "none"
        if not self.enabled:
            return
        uri = cfg.tracking_uri or default_tracking_uri(cfg.out_dir)
        try:
            import mlflow

            os.makedirs(cfg.out_dir, exist_ok=True)
            mlflow.set_tracking_uri(uri)
            mlflow.set_experiment(EXPERIMENT)
            run = mlflow.start_run(run_id=resume_run_id) if resume_run_id else mlflow.start_run(run_name=cfg.run_name)
            self._mlflow, self.run_id = mlflow, run.info.run_id
            log(env, f"MLflow: run {self.run_id} in experiment '{EXPERIMENT}' at {uri}"
                     + (" (resumed)" if resume_run_id else ""))
        except Exception as exc:  # noqa: BLE001 - tracking must never stop training
            self._disable(f"cannot start MLflow at {uri}: {type(exc).__name__}: {exc}")

    def _disable(self, why: str) -> None:
        log(self.env, f"WARNING: {why}; training continues without MLflow")
        self.enabled, self._mlflow = False, None

    def log_params(self, params: dict[str, Any]) -> None:
        if not self.enabled:
            return
        try:
            existing = self._mlflow.get_run(self.run_id).data.params
            fresh = {k: str(v)[:500] for k, v in params.items() if k not in existing}
            if fresh:
                self._mlflow.log_params(fresh)
        except Exception as exc:  # noqa: BLE001
            self._disable(f"MLflow log_params failed: {exc}")

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if not self.enabled:
            return
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        self._pending += [Metric(k, float(v), now_ms, step) for k, v in metrics.items()]
        if time.monotonic() - self._last_flush > FLUSH_SECONDS:
            self.flush()

    def flush(self) -> None:
        if not self.enabled or not self._pending:
            return
        try:
            self._mlflow.MlflowClient().log_batch(self.run_id, metrics=self._pending)
        except Exception as exc:  # noqa: BLE001
            self._disable(f"MLflow log_batch failed: {exc}")
        self._pending, self._last_flush = [], time.monotonic()

    def finish(self, status: str = "FINISHED") -> None:
        """End the MLflow run: FINISHED at the last step, KILLED when stopped (a resumed run reopens it)."""
        self.flush()
        if self.enabled:
            try:
                self._mlflow.end_run(status=status)
            except Exception as exc:  # noqa: BLE001
                self._disable(f"MLflow end_run failed: {exc}")
