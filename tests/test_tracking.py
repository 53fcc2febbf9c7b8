"""The MLflow tracker never holds the step loop: a server that hangs, one that is away and comes
back, one that refuses the credentials. In-process, on loopback and a sqlite store."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from mlflow.exceptions import MlflowException
from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore
from mlflow.tracking import MlflowClient

from nanochat_cpu import tracking
from nanochat_cpu.config import TrainConfig
from nanochat_cpu.dist import DistEnv
from nanochat_cpu.tracking import Tracker, charts_link, finish_seconds, shown_uri
from tests.trainer_runs import free_port, kill_tree, losses, run_torchrun, tiny_flags, train_target

STEP_BOUND_S = 0.2  # what one log call may cost the step loop
SECRET = "pw-that-must-never-be-logged"


@pytest.fixture(autouse=True)
def fast_client(monkeypatch: pytest.MonkeyPatch) -> None:
    """One-second requests without retries (the old synchronous tracker, under these, blocked its
    constructor for a second and then gave up for good: both are what these tests catch)."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "1")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "trainer")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", SECRET)
    monkeypatch.setattr(tracking, "FLUSH_SECONDS", 0.0)  # every log call hands a batch to the worker
    monkeypatch.setattr(tracking, "RETRY_SECONDS", 0.1)


def until(condition: Callable[[], bool], seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def timed(call: Callable[[], object]) -> float:
    t0 = time.monotonic()
    call()
    return time.monotonic() - t0


def make_tracker(uri: str, out_dir: Path, resume_run_id: str | None = None) -> tuple[Tracker, float]:
    cfg = TrainConfig(tracking_uri=uri, out_dir=str(out_dir), run_name="test")
    t0 = time.monotonic()
    tracker = Tracker(cfg, DistEnv(), resume_run_id)
    return tracker, time.monotonic() - t0


def log_steps(tracker: Tracker, steps: range) -> float:
    """The slowest log call over these steps."""
    return max(timed(lambda s=s: tracker.log_metrics({"train_loss": 1.0 / (s + 1), "tok_per_s": 100.0}, s))
               for s in steps)


@pytest.fixture
def hung_server() -> Iterator[str]:
    """Accepts connections and never answers a byte."""
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                held.append(listener.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    listener.close()
    for conn in held:
        conn.close()


def test_a_hung_server_costs_the_step_loop_nothing(hung_server, tmp_path, capsys):
    tracker, took = make_tracker(hung_server, tmp_path)
    assert took < STEP_BOUND_S
    assert timed(lambda: tracker.log_params({"depth": 4})) < STEP_BOUND_S
    assert log_steps(tracker, range(1, 21)) < STEP_BOUND_S
    assert until(lambda: bool(tracker._down))
    assert tracker.enabled  # still waiting for the server, not given up
    assert timed(lambda: tracker.run_id) < 1.5 and tracker.run_id is None  # one bounded wait, then none
    assert log_steps(tracker, range(21, 41)) < STEP_BOUND_S
    took = timed(tracker.finish)
    assert took < finish_seconds() + 0.5
    out = capsys.readouterr().out
    [warning] = [line for line in out.splitlines() if "does not answer" in line]
    assert f"WARNING: MLflow at {hung_server} does not answer" in warning and "training goes on" in warning
    assert "did not take the run's last" in out and "gave up on them" in out and SECRET not in out


class Outage:
    """Makes a real sqlite store fail as a server that is away does (an MlflowException, HTTP 500)."""

    METHODS = ("get_experiment_by_name", "create_experiment", "create_run", "update_run_info", "get_run",
               "log_batch")

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.down = False
        for name in self.METHODS:
            monkeypatch.setattr(SqlAlchemyStore, name, self.gated(getattr(SqlAlchemyStore, name)))

    def gated(self, method: Callable) -> Callable:
        def call(store: SqlAlchemyStore, *args: object, **kwargs: object) -> object:
            if self.down:
                raise MlflowException("API request to http://master:5000 failed with exception ConnectionRefused")
            return method(store, *args, **kwargs)
        return call


@pytest.fixture(scope="module")
def store_uri(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One sqlite store for the module: creating its tables takes seconds."""
    uri = "sqlite:///" + str(tmp_path_factory.mktemp("mlflow") / "mlflow.db")
    MlflowClient(tracking_uri=uri).search_experiments()
    return uri


def steps_logged(uri: str, run_id: str) -> list[int]:
    return sorted(m.step for m in MlflowClient(tracking_uri=uri).get_metric_history(run_id, "train_loss"))


def test_a_run_started_while_the_store_is_away_starts_when_it_is_back(store_uri, tmp_path, monkeypatch, capsys):
    outage = Outage(monkeypatch)
    outage.down = True
    tracker, took = make_tracker(store_uri, tmp_path)
    tracker.log_params({"depth": 4})
    assert log_steps(tracker, range(1, 6)) < STEP_BOUND_S and took < STEP_BOUND_S
    assert until(lambda: bool(tracker._down))
    assert "does not answer" in capsys.readouterr().out
    outage.down = False
    assert until(lambda: tracker.run_id is not None)
    log_steps(tracker, range(6, 9))
    tracker.finish()
    out = capsys.readouterr().out
    assert "answers again: logging resumes (0 metric batch(es) dropped" in out and "gave up" not in out
    run = MlflowClient(tracking_uri=store_uri).get_run(tracker.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "test" and run.data.params["depth"] == "4"
    assert steps_logged(store_uri, tracker.run_id) == list(range(1, 9))


def test_an_interrupted_store_drops_the_oldest_batches_and_says_how_many(store_uri, tmp_path, monkeypatch,
                                                                          capsys):
    outage = Outage(monkeypatch)
    monkeypatch.setattr(tracking, "MAX_QUEUED_BATCHES", 3)
    tracker, _ = make_tracker(store_uri, tmp_path)
    log_steps(tracker, range(1, 3))
    assert until(lambda: tracker.run_id is not None and not tracker._jobs and not tracker._busy)
    outage.down = True
    assert log_steps(tracker, range(3, 13)) < STEP_BOUND_S  # ten batches, room for three
    assert until(lambda: bool(tracker._down))
    outage.down = False
    tracker.finish("KILLED")
    out = capsys.readouterr().out
    assert out.count("does not answer") == 1
    assert "answers again: logging resumes" in out
    dropped = int(out.split("logging resumes (")[1].split(" ")[0])
    assert dropped >= 6  # ten batches queued behind at most one in flight, three kept
    kept = steps_logged(store_uri, tracker.run_id)
    assert kept[:2] == [1, 2] and kept[-3:] == [10, 11, 12]  # the newest ones made it
    assert MlflowClient(tracking_uri=store_uri).get_run(tracker.run_id).info.status == "KILLED"


def test_a_resumed_run_keeps_its_id_and_params(store_uri, tmp_path):
    first, _ = make_tracker(store_uri, tmp_path)
    first.log_params({"depth": 4})
    first.finish("KILLED")
    run_id = first.run_id
    again, _ = make_tracker(store_uri, tmp_path, resume_run_id=run_id)
    assert again.run_id == run_id  # known at once: the checkpoint code reads it
    again.log_params({"depth": 4, "world_size": 2})
    log_steps(again, range(1, 3))
    again.finish()
    run = MlflowClient(tracking_uri=store_uri).get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.params == {"depth": "4", "world_size": "2"}


def test_batches_the_store_refuses_are_dropped_with_one_warning(store_uri, tmp_path, monkeypatch, capsys):
    def refuse(*_args: object, **_kwargs: object) -> None:
        raise MlflowException.invalid_parameter_value("The run must be in the 'active' state")

    tracker, _ = make_tracker(store_uri, tmp_path)
    assert until(lambda: tracker.run_id is not None)
    monkeypatch.setattr(SqlAlchemyStore, "log_batch", refuse)
    log_steps(tracker, range(1, 5))
    tracker.finish()
    out = capsys.readouterr().out
    assert out.count("refused the metrics") == 1 and "does not answer" not in out and "gave up" not in out


class Refuses(BaseHTTPRequestHandler):
    """What MLflow's basic-auth app answers to a wrong password."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(401)
        self.send_header("WWW-Authenticate", 'Basic realm="mlflow"')
        self.end_headers()
        self.wfile.write(b"You are not authenticated.")

    do_POST = do_PATCH = do_GET

    def log_message(self, *args: object) -> None:
        pass


def test_refused_credentials_get_one_clear_warning_without_them(tmp_path, capsys):
    server = ThreadingHTTPServer(("127.0.0.1", 0), Refuses)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    uri = f"http://trainer:{SECRET}@127.0.0.1:{server.server_port}"
    try:
        tracker, _ = make_tracker(uri, tmp_path)
        log_steps(tracker, range(1, 4))
        assert until(lambda: bool(tracker._down))
        time.sleep(0.3)  # a few retries more: still one warning
        tracker.finish()
    finally:
        server.shutdown()
    out = capsys.readouterr().out
    assert out.count("WARNING: MLflow refused the credentials (HTTP 401)") == 1
    assert "fix: set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD" in out
    assert SECRET not in out and f"http://***@127.0.0.1:{server.server_port}" in out


def test_the_charts_link_is_the_servers_page_or_a_local_stores_command_and_page():
    page = "#/experiments/3/runs/ab12/model-metrics?workflowType=machine_learning"
    assert charts_link("http://u:p@10.0.0.1:5000/", page) == f"http://***@10.0.0.1:5000/{page}"
    assert charts_link("https://mlflow.lan", page) == f"https://mlflow.lan/{page}"
    assert charts_link("sqlite:////srv/runs/d4/mlflow.db", page) == \
        f"`mlflow ui --backend-store-uri sqlite:////srv/runs/d4/mlflow.db`, then http://127.0.0.1:5000/{page}"


@pytest.fixture(scope="module")
def server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real MLflow tracking server on loopback (no auth of its own: credentials in the URI reach it
    as a basic-auth header, which it ignores), on its own sqlite store."""
    where = tmp_path_factory.mktemp("mlflow_server")
    port = free_port()
    cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{where / 'mlflow.db'}",
           "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    with open(where / "server.log", "w") as log_file:
        server = subprocess.Popen(cmd, env={**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true"},
                                  stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        def healthy() -> bool:
            assert server.poll() is None, (where / "server.log").read_text()
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as answer:
                    return answer.status == 200
            except OSError:
                return False
        assert until(healthy, 120), (where / "server.log").read_text()
        yield url
    finally:
        kill_tree(server.pid, signal.SIGKILL)
        server.wait(timeout=30)


def test_credentials_in_the_tracking_uri_stay_out_of_the_runs_params(server_url, tmp_path, monkeypatch):
    """A user who writes user:password@ into --tracking-uri (a URL MLflow's client takes) finds it in
    no param of the run: the trainer logs its flags, --tracking-uri among them, as the journal shows
    the URI. (The store held the password in clear before.)"""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")  # a real server on a loaded machine: no race
    uri = server_url.replace("http://", f"http://trainer:{SECRET}@")
    cfg = TrainConfig(tracking_uri=uri, out_dir=str(tmp_path), run_name="creds")
    tracker = Tracker(cfg, DistEnv(), None)
    tracker.log_params({**dataclasses.asdict(cfg), "world_size": 1})  # as train.py logs the run's flags
    tracker.finish()
    params = MlflowClient(tracking_uri=server_url).get_run(tracker.run_id).data.params
    assert params["tracking_uri"] == server_url.replace("http://", "http://***@"), params
    assert SECRET not in json.dumps(params), params


def test_shown_uri_hides_credentials_only():
    assert shown_uri("http://u:p@master:5000/x") == "http://***@master:5000/x"
    assert shown_uri("http://master:5000") == "http://master:5000"
    assert shown_uri("sqlite:////srv/runs/mlflow.db") == "sqlite:////srv/runs/mlflow.db"


def test_none_and_other_ranks_do_nothing(tmp_path):
    tracker = Tracker(TrainConfig(tracking_uri="none", out_dir=str(tmp_path)), DistEnv(), None)
    rank1 = Tracker(TrainConfig(out_dir=str(tmp_path / "r1")), DistEnv(rank=1, world_size=2), "abc")
    for t in (tracker, rank1):
        t.log_params({"a": 1})
        t.log_metrics({"x": 1.0}, 1)
        t.finish()
    assert not tracker.enabled and not rank1.enabled and rank1.run_id == "abc"
    assert not (tmp_path / "r1").exists()


def test_a_training_run_logging_to_a_hung_server_trains_to_its_end(hung_server, tiny_data_dir, tiny_tokenizer_dir,
                                                                    tmp_path, monkeypatch: pytest.MonkeyPatch):
    """The whole trainer under the product's own client settings (5 s requests, one retry): every
    step is taken, the journal says once that MLflow does not answer, and the exit waits only
    finish()'s bound for it."""
    for name in ("MLFLOW_HTTP_REQUEST_TIMEOUT", "MLFLOW_HTTP_REQUEST_MAX_RETRIES"):
        monkeypatch.delenv(name)
    flags = tiny_flags(tiny_data_dir, tiny_tokenizer_dir, tmp_path, tracking_uri=hung_server, num_iterations=8)
    proc = run_torchrun(2, train_target(*flags), timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert sorted(losses(proc.stdout)) == list(range(1, 9))
    assert out.count(f"WARNING: MLflow at {hung_server} does not answer") <= 1, out  # said once, if at all
    assert "gave up on them" in out and SECRET not in out
