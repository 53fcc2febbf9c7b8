"""MLflow logging from rank 0 that never stalls training and never takes the run down with it.

Default store: sqlite under `--out-dir` (MLflow's file store is in maintenance mode). With a
tracking server (`--tracking-uri http://master:5000`) the curves of every run land in one UI.

Every call to the store (starting the run, parameters, metric batches, ending it) happens on one
background thread, fed by a bounded queue: the step loop only appends to a list, so a server
that is down, or that accepts connections and never answers, costs training nothing. While it
does not answer, the worker says so once, keeps the jobs and tries again every RETRY_SECONDS;
when the queue is full the oldest metric batches go (counted, and said when the server is back).
A run started while the server was down is started in MLflow when it answers. A resumed run
keeps logging to the same MLflow run (its id is stored in the checkpoints).

The run's page: metrics are named `<section>/<name>`, and MLflow draws each section apart, sorted
by name: `loss/` (train_loss, val_bpb) first, then `optimizer/`, `outer/` (local steps' syncs),
`ranks/` (each rank's times), `speed/` and `time/`. The experiment is marked as model training
(KIND_TAG), and the log line that starts the run gives the link to its charts (CHARTS_PAGE).

Credentials: MLflow's client reads MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD itself;
nothing here reads or logs them, and a URI is logged without any user:password@ in it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from .config import TrainConfig
from .dist import DistEnv, log

EXPERIMENT = "nanochat_cpu"
# MLflow 3 opens an experiment on its GenAI pages (traces, "Evaluation runs") unless told it holds
# model training: the experiment's kind, and the page's `workflowType`, which a link must carry
KIND_TAG, KIND = "mlflow.experimentKind", "custom_model_development"
CHARTS_PAGE = "#/experiments/{experiment}/runs/{run}/model-metrics?workflowType=machine_learning"
LOCAL_UI = "http://127.0.0.1:5000"  # where `mlflow ui` serves a local store unless told otherwise
FLUSH_SECONDS = 10.0  # metrics are batched: one sqlite/HTTP write per flush, not per step
RETRY_SECONDS = 10.0  # while the store does not answer, the worker tries its oldest job again this often
MAX_QUEUED_BATCHES = 360  # an hour of flushes kept while the server is away; then the oldest go
# MLflow's own defaults wait 120 s for an answer and retry 7 times with backoff: minutes per call.
# A short wait and one retry keep the worker responsive (and finish() short); what a user exported wins.
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "5", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
                 "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1"}
AUTH_FIX = ("fix: set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD to an account of the server "
            "(the trainer unit reads them from its credentials file, see roles/mlflow)")


def default_tracking_uri(out_dir: str) -> str:
    return "sqlite:///" + os.path.abspath(os.path.join(out_dir, "mlflow.db"))


def charts_link(uri: str, page: str) -> str:
    """Where a user opens the run's charts: the server's page, or a local store's command and page."""
    shown = shown_uri(uri)
    if shown.startswith(("http://", "https://")):
        return f"{shown.rstrip('/')}/{page}"
    return f"`mlflow ui --backend-store-uri {shown}`, then {LOCAL_UI}/{page}"


def shown_uri(uri: str) -> str:
    """The URI as logged: without credentials, should someone have put them in it."""
    parts = urlsplit(uri)
    if "@" not in parts.netloc:
        return uri
    return urlunsplit(parts._replace(netloc="***@" + parts.netloc.rsplit("@", 1)[1]))


def request_timeout() -> float:
    """Seconds MLflow's client waits for one answer (ours, or what the user exported)."""
    ours = HTTP_DEFAULTS["MLFLOW_HTTP_REQUEST_TIMEOUT"]
    try:
        return float(os.environ.get("MLFLOW_HTTP_REQUEST_TIMEOUT", ours))
    except ValueError:  # MLflow's client refuses it too (and the worker says so): never stop the run over it
        return float(ours)


def http_status(exc: BaseException) -> int:
    """The HTTP status MLflow maps an error to; 500 for anything that is not an MlflowException
    (a refused connection and a timeout are MlflowExceptions with status 500 too)."""
    status = getattr(exc, "get_http_status_code", None)
    return status() if callable(status) else 500


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc)[:300]}"  # the body of an HTML error page is no use in a log line


class Tracker:
    """Rank 0's MLflow run. Every public method returns without waiting for the store, except
    finish() (at most finish_seconds()) and the first read of run_id of a fresh run (at most
    request_timeout(), once)."""

    def __init__(self, cfg: TrainConfig, env: DistEnv, resume_run_id: str | None):
        self.env = env
        self._run_id = resume_run_id
        self.charts: str | None = None  # where the user opens this run's charts, once the store started it
        self._pending: list[tuple[str, float, int, int]] = []
        self._last_flush = time.monotonic()
        self._waited = False  # whether run_id waited for the start already
        self.enabled = env.master and cfg.tracking_uri.lower() != "none"
        if not self.enabled:
            return
        for name, value in HTTP_DEFAULTS.items():  # before MLflow's client first reads them
            os.environ.setdefault(name, value)
        self.uri = cfg.tracking_uri or default_tracking_uri(cfg.out_dir)
        os.makedirs(cfg.out_dir, exist_ok=True)
        # the run starts now, not when the store first answers (a new sqlite store takes seconds to
        # create): MLflow's Duration column is the training's
        started_ms = int(time.time() * 1000)
        self._jobs: deque[tuple[str, Any]] = deque([("start", (resume_run_id, cfg.run_name, started_ms))])
        self._busy = True  # a job is being worked on, or waits for the worker to start
        self._cond = threading.Condition()
        self._wake = threading.Event()  # cuts a retry wait short (finish)
        self._start_tried = threading.Event()  # the first attempt to start the run is over
        self._down = ""  # why the store does not answer; empty while it does
        self._dropped = 0  # metric batches dropped since the store last answered
        self._refused: set[str] = set()  # kinds of job the store refused (and said so)
        self._worker = threading.Thread(target=self._work, name="mlflow", daemon=True)
        self._worker.start()

    @property
    def run_id(self) -> str | None:
        """The MLflow run id, for the checkpoints; None while the store has not started the run."""
        if self.enabled and self._run_id is None and not self._waited:
            self._waited = True  # a store that does not answer costs this wait once, not every checkpoint
            self._start_tried.wait(request_timeout())  # a fresh local store takes seconds to create
        return self._run_id

    def log_params(self, params: dict[str, Any]) -> None:
        if self.enabled:
            # the run's flags hold --tracking-uri: the store gets it as the journal shows it
            shown = shown_uri(self.uri)
            self._submit("params", {k: str(v).replace(self.uri, shown)[:500] for k, v in params.items()})

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if not self.enabled:
            return
        now_ms = int(time.time() * 1000)
        self._pending += [(k, float(v), now_ms, step) for k, v in metrics.items()]
        if time.monotonic() - self._last_flush > FLUSH_SECONDS:
            self.flush()

    def flush(self) -> None:
        """Hand the metrics gathered since the last flush to the worker."""
        if self.enabled and self._pending:
            self._submit("metrics", self._pending)
        self._pending, self._last_flush = [], time.monotonic()

    def finish(self, status: str = "FINISHED") -> None:
        """End the MLflow run: FINISHED at the last step, KILLED when stopped (a resumed run reopens it).
        Waits at most finish_seconds() for the store, then says what it gave up."""
        if not self.enabled:
            return
        self.flush()
        self._submit("end", status)
        self._wake.set()  # a worker waiting to retry tries now
        bound = finish_seconds()
        with self._cond:
            done = self._cond.wait_for(lambda: not self._jobs and not self._busy, timeout=bound)
            left = len(self._jobs) + self._busy
        if not done:
            log(self.env, f"WARNING: MLflow at {shown_uri(self.uri)} did not take the run's last {left} job(s) "
                          f"within {bound:.0f} s ({self._down or 'still busy'}); gave up on them, the run ends "
                          f"without them")

    # ---- the worker thread ------------------------------------------------------------------------

    def _submit(self, kind: str, payload: Any) -> None:
        with self._cond:
            queued = [i for i, (k, _) in enumerate(self._jobs) if k == "metrics"]
            if kind == "metrics" and len(queued) >= MAX_QUEUED_BATCHES:
                del self._jobs[queued[0]]
                self._dropped += 1
            self._jobs.append((kind, payload))
            self._cond.notify_all()

    def _work(self) -> None:
        try:
            from mlflow.tracking import MlflowClient

            # urllib3 logs a warning per retried request: with the store away that is a line every
            # RETRY_SECONDS; _went_down says it once instead
            logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)
            client = MlflowClient(tracking_uri=self.uri)
        except Exception as exc:  # noqa: BLE001 - tracking must never stop training
            return self._give_up(f"cannot load MLflow's client: {describe(exc)}")
        while True:
            with self._cond:
                self._busy = False
                self._cond.notify_all()
                self._cond.wait_for(lambda: bool(self._jobs))
                kind, payload = self._jobs.popleft()
                self._busy = True
            if not self._attempt(client, kind, payload):
                with self._cond:
                    self._jobs.appendleft((kind, payload))  # tried again first: the run's order is kept
                self._wake.wait(RETRY_SECONDS)
                self._wake.clear()
            elif kind == "end" or not self.enabled:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
                return

    def _attempt(self, client: Any, kind: str, payload: Any) -> bool:
        """Do one job; False when the store did not answer (the job is kept), True otherwise."""
        try:
            self._do(client, kind, payload)
        except Exception as exc:  # noqa: BLE001
            status = http_status(exc)
            if status in (401, 403, 429) or status >= 500:
                self._went_down(exc, status)
                if kind == "start":
                    self._start_tried.set()
                return False
            if kind == "start":  # the store answered and refused: nothing else can be logged either
                self._give_up(f"MLflow at {shown_uri(self.uri)} refused to start the run: {describe(exc)}")
            elif kind not in self._refused:  # a deleted run refuses every batch: said once, not every flush
                self._refused.add(kind)
                log(self.env, f"WARNING: MLflow at {shown_uri(self.uri)} refused the {kind}: {describe(exc)}; "
                              f"dropped them (and any it refuses later), training goes on")
        self._came_back()
        return True

    def _do(self, client: Any, kind: str, payload: Any) -> None:
        from mlflow.entities import Metric, Param

        if kind == "start":
            self._run_id = self._start(client, *payload)
            self._start_tried.set()
        elif kind == "params":  # a resumed run has them already: MLflow refuses to change a logged param
            logged = client.get_run(self._run_id).data.params
            fresh = [Param(k, v) for k, v in payload.items() if k not in logged]
            if fresh:
                client.log_batch(self._run_id, params=fresh)
        elif kind == "metrics":
            client.log_batch(self._run_id, metrics=[Metric(*m) for m in payload])
        else:
            client.set_terminated(self._run_id, status=payload)

    def _start(self, client: Any, resume_run_id: str | None, run_name: str, started_ms: int) -> str:
        from mlflow.exceptions import MlflowException
        from mlflow.tracking.context.registry import resolve_tags

        where = f"in experiment '{EXPERIMENT}' at {shown_uri(self.uri)}"
        if resume_run_id:
            try:
                client.update_run(resume_run_id, status="RUNNING")
                self._opened(client.get_run(resume_run_id).info.experiment_id, resume_run_id, f"{where} (resumed)")
                return resume_run_id
            except MlflowException as exc:
                if http_status(exc) != 404:
                    raise
                log(self.env, f"WARNING: MLflow: run {resume_run_id} of the checkpoint is not {where}; "
                              f"starting a new run")
        experiment = client.get_experiment_by_name(EXPERIMENT)
        if experiment is None:
            experiment_id = client.create_experiment(EXPERIMENT, tags={KIND_TAG: KIND})
        else:
            experiment_id = experiment.experiment_id
            if experiment.tags.get(KIND_TAG) != KIND:  # made by an older version, or by hand
                client.set_experiment_tag(experiment_id, KIND_TAG, KIND)
        run = client.create_run(experiment_id, start_time=started_ms, run_name=run_name, tags=resolve_tags())
        self._opened(experiment_id, run.info.run_id, where)
        return run.info.run_id

    def _opened(self, experiment_id: str, run_id: str, where: str) -> None:
        self.charts = charts_link(self.uri, CHARTS_PAGE.format(experiment=experiment_id, run=run_id))
        log(self.env, f"MLflow: run {run_id} {where}; its charts: {self.charts}")

    def _went_down(self, exc: BaseException, status: int) -> None:
        if self._down:
            return
        if status in (401, 403):
            why = f"MLflow refused the credentials (HTTP {status})"
            log(self.env, f"WARNING: {why} at {shown_uri(self.uri)}; {AUTH_FIX}. Training goes on, logging resumes "
                          f"once the server accepts them")
        else:
            why = describe(exc)
            log(self.env, f"WARNING: MLflow at {shown_uri(self.uri)} does not answer ({why}); training goes on, "
                          f"metrics wait in memory and are sent when it is back (tried every {RETRY_SECONDS:.0f} s)")
        self._down = why

    def _came_back(self) -> None:
        if not self._down:
            return
        with self._cond:
            dropped, self._dropped = self._dropped, 0
        self._down = ""
        log(self.env, f"MLflow at {shown_uri(self.uri)} answers again: logging resumes "
                      f"({dropped} metric batch(es) dropped while it was away)")

    def _give_up(self, why: str) -> None:
        log(self.env, f"WARNING: {why}; training continues without MLflow")
        self.enabled = False
        self._start_tried.set()


def finish_seconds() -> float:
    """How long finish() waits for the store: two request timeouts (one request and its retry)."""
    return 2 * request_timeout()
