"""The curves a user opens: the link to the run's charts that the trainer prints (and status.yml
repeats), over the store of a short real training run, in a real headless Chromium, behind the
`mlflow ui --backend-store-uri sqlite:///...` the link names. The page must be MLflow's model-training
view (not its GenAI "Evaluation runs"), its first charts the train loss and val bpb, and the charts
are read from what the browser rendered: the SVG markers of each curve and the pixels of the screenshot.

The browser is the system's chromium (`make setup` installs it: cluster/host_setup.sh), driven by
playwright from the venv; set NANOCHAT_UI_SCREENSHOT_DIR to keep the screenshot where a person can look.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path

import numpy as np
import pytest
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient
from PIL import Image

from nanochat_cpu.run_status import STATUS_FILE
from nanochat_cpu.tracking import EXPERIMENT, LOCAL_UI
from tests.trainer_runs import REPO, free_port, kill_tree, node_env, tiny_flags, train_target

STEPS = 6
EVAL_EVERY = 2  # val_bpb at steps 2, 4 and 6: a curve, not a dot
UI_TIMEOUT_MS = 60_000  # the UI's first load parses megabytes of JavaScript: slow on 2 busy cores
NOT_LOGGED = "outer/outer_sync_s"  # logged with local steps only; this run syncs every step
TRAIN_LOSS, VAL_BPB = "loss/train_loss", "loss/val_bpb"
# MLflow sends usage telemetry unless told not to: no calls out of a test machine that may have no internet
NO_TELEMETRY = {"MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true"}
FIX = "install it with `make setup` (cluster/host_setup.sh installs chromium, requirements-dev.txt playwright)"


# ---- a real run, its store and the UI over it ----------------------------------------------------------

@dataclass
class LoggedRun:
    store: str  # the sqlite store's URI
    link: str  # the page of the run's charts, as the trainer's log line and status file give it


@pytest.fixture(scope="module")
def logged_run(tiny_data_dir: Path, tiny_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> LoggedRun:
    """A short single-process training run's sqlite store, and the link to its charts it printed."""
    out = tmp_path_factory.mktemp("ui_run")
    uri = "sqlite:///" + str(out / "mlflow.db")
    flags = tiny_flags(tiny_data_dir, tiny_tokenizer_dir, out, tracking_uri=uri, num_iterations=STEPS,
                       eval_every=EVAL_EVERY, checkpoint_every=0)
    proc = subprocess.run([sys.executable, *train_target(*flags)], env={**node_env(), **NO_TELEMETRY},
                          capture_output=True, text=True, timeout=180, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    said = re.search(r"its charts: (`mlflow ui --backend-store-uri \S+`, then \S+)", proc.stdout)
    assert said, proc.stdout
    status = json.loads((out / STATUS_FILE).read_text())
    assert status["mlflow_charts"] == said[1]  # what status.yml's summary shows
    command, page = said[1].split(", then ")
    assert command == f"`mlflow ui --backend-store-uri {uri}`" and page.startswith(LOCAL_UI + "/#/")
    return LoggedRun(uri, page.removeprefix(LOCAL_UI + "/"))


@pytest.fixture(scope="module")
def store(logged_run: LoggedRun) -> str:
    return logged_run.store


@pytest.fixture(scope="module")
def ui_url(store: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`mlflow ui` as the demo prints it, on a free loopback port, one worker (two cores)."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("ui_server") / "mlflow-ui.log"
    cmd = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", store, "--host", "127.0.0.1",
           "--port", str(port), "--workers", "1"]
    with open(log_path, "w") as log_file:
        server = subprocess.Popen(cmd, env={**os.environ, **NO_TELEMETRY}, stdout=log_file,
                                  stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, server, log_path)
        yield url
    finally:
        kill_tree(server.pid, signal.SIGKILL)  # uvicorn's graceful stop waits seconds for idle connections
        server.wait(timeout=30)


def wait_healthy(url: str, server: subprocess.Popen, log_path: Path, seconds: float = 90) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert server.poll() is None, f"mlflow ui exited {server.returncode}:\n{log_path.read_text()}"
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as answer:
                if answer.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise AssertionError(f"mlflow ui did not answer /health within {seconds:.0f} s:\n{log_path.read_text()}")


@pytest.fixture(scope="module")
def browser():
    """Headless system chromium under playwright: missing either fails (before the run is made), naming the fix."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as exc:
        raise AssertionError(f"playwright is not installed: {FIX}") from exc
    executable = shutil.which("chromium") or shutil.which("chromium-browser")
    assert executable, f"no chromium on PATH: {FIX}"
    with sync_playwright() as driver:
        launched = driver.chromium.launch(executable_path=executable)
        yield launched
        launched.close()


def open_link(browser, ui_url: str, link: str):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(UI_TIMEOUT_MS)
    page.goto(f"{ui_url}/{link}")
    return page


@pytest.fixture(scope="module")
def metrics_page(browser, ui_url: str, logged_run: LoggedRun):
    """The page the printed link opens, once its charts are there."""
    page = open_link(browser, ui_url, logged_run.link)
    page.get_by_test_id("experiment-view-compare-runs-card").first.wait_for()
    return page


def view(page) -> str:
    """Which of MLflow's views the page shows, by the experiment's links in its side bar."""
    page.get_by_role("link", name="Traces", exact=True).first.wait_for()  # in both views' side bars
    if page.get_by_role("link", name="Evaluation runs", exact=True).count():
        return "GenAI"
    runs = page.get_by_role("link", name="Runs", exact=True)
    return "model training" if runs.count() else "neither"


def chart_titles(page) -> list[str]:
    """The titles of the charts, in the order the page shows them (top to bottom, left to right)."""
    cards = page.get_by_test_id("experiment-view-compare-runs-card")
    return cards.evaluate_all("cs => cs.map(c => [c.getBoundingClientRect().top, c.getBoundingClientRect().left,"
                              " (c.querySelector('h4') || {}).innerText || ''])"
                              ".sort((a, b) => a[0] - b[0] || a[1] - b[1]).map(c => c[2])")


# ---- reading a chart off the rendered page -------------------------------------------------------------

def chart(page, metric: str):
    """The chart card of `metric` (titled with its name within its section); fails at once when the page has none."""
    title = page.get_by_role("heading", name=metric.split("/")[-1], exact=True)
    card = page.get_by_test_id("experiment-view-compare-runs-card").filter(has=title)
    assert card.count() == 1, f"the run's Model metrics tab has no chart for {metric}"
    return card


def assert_chart_draws(page, metric: str, history: list[Metric]) -> None:
    """The chart of `metric` draws exactly `history`: one marker per logged step, placed linearly in
    (step, value) with the higher value higher up, and painted: at least as many pixels of the curve's
    colour in the browser's screenshot of the plot as its line is long."""
    from playwright.sync_api import expect

    card = chart(page, metric)
    card.scroll_into_view_if_needed()
    markers = card.locator(".scatterlayer .trace").first.locator(".point")
    expect(markers).to_have_count(len(history), timeout=UI_TIMEOUT_MS)  # waits for plotly to draw
    centres = np.array(markers.evaluate_all(
        "ps => ps.map(p => { const b = p.getBoundingClientRect(); return [b.x + b.width / 2, b.y + b.height / 2]; })"))
    steps = np.array([m.step for m in history], float)
    values = np.array([m.value for m in history])
    for pixels, data, axis in ((centres[:, 0], steps, "x"), (centres[:, 1], values, "y")):
        slope, offset = np.polyfit(data, pixels, 1)
        off_by = np.abs(slope * data + offset - pixels).max()
        assert off_by < 1.5, f"{metric}: markers are {off_by:.1f} px off a linear {axis} axis of the logged values"
        assert (slope > 0) if axis == "x" else (slope < 0), f"{metric}: {axis} axis runs the wrong way"
    colour = markers.first.evaluate("p => getComputedStyle(p).fill")  # 'rgb(34, 114, 180)'
    painted = painted_pixels(card.locator(".js-plotly-plot").screenshot(), colour)  # the legend is outside it
    line_px = np.linalg.norm(np.diff(centres, axis=0), axis=1).sum()
    assert painted >= line_px, f"{metric}: {painted} px of the curve's colour {colour} on the screen, " \
                               f"fewer than its line is long ({line_px:.0f} px): not drawn"


def painted_pixels(png: bytes, css_rgb: str) -> int:
    """Pixels within a few levels of a CSS rgb() colour: the markers and line of a curve."""
    want = np.array([int(c) for c in css_rgb[css_rgb.index("(") + 1:-1].split(",")[:3]])
    rgb = np.asarray(Image.open(BytesIO(png)).convert("RGB"), dtype=int)
    return int((np.abs(rgb - want).max(axis=2) <= 8).sum())


def history(store: str, metric: str) -> list[Metric]:
    """What the run logged of `metric`, by step."""
    client = MlflowClient(tracking_uri=store)
    [run] = client.search_runs([client.get_experiment_by_name(EXPERIMENT).experiment_id])
    return sorted(client.get_metric_history(run.info.run_id, metric), key=lambda m: m.step)


# ---- the checks ----------------------------------------------------------------------------------------

def test_the_printed_link_opens_the_model_training_view_on_loss_and_val_bpb(metrics_page):
    assert view(metrics_page) == "model training"
    assert chart_titles(metrics_page)[:2] == ["train_loss", "val_bpb"], chart_titles(metrics_page)


def test_the_check_of_the_view_can_fail(browser, ui_url, logged_run):
    """The same page without the link's workflowType is MLflow's GenAI view (a fresh browser's default):
    view() tells them apart."""
    page = open_link(browser, ui_url, logged_run.link.split("?")[0])
    try:
        page.get_by_test_id("experiment-view-compare-runs-card").first.wait_for()
        assert view(page) == "GenAI"
    finally:
        page.close()


def test_the_run_page_draws_the_train_loss_and_val_bpb_curves(metrics_page, store, tmp_path):
    train_loss, val_bpb = history(store, TRAIN_LOSS), history(store, VAL_BPB)
    assert len(train_loss) == STEPS and len(val_bpb) == STEPS // EVAL_EVERY
    try:
        assert_chart_draws(metrics_page, TRAIN_LOSS, train_loss)
        assert_chart_draws(metrics_page, VAL_BPB, val_bpb)
    finally:  # what the user would see, pass or fail
        shot = tmp_path / "mlflow-run-model-metrics.png"
        metrics_page.screenshot(path=str(shot))
        if os.environ.get("NANOCHAT_UI_SCREENSHOT_DIR"):
            keep = Path(os.environ["NANOCHAT_UI_SCREENSHOT_DIR"])
            keep.mkdir(parents=True, exist_ok=True)
            shutil.copy(shot, keep / shot.name)


def test_every_metric_has_a_section_and_the_experiment_is_model_training(store):
    """A metric without a `section/` lands in a catch-all section after the others; the experiment's
    kind tells MLflow what it holds."""
    client = MlflowClient(tracking_uri=store)
    experiment = client.get_experiment_by_name(EXPERIMENT)
    assert experiment.tags.get("mlflow.experimentKind") == "custom_model_development"
    [run] = client.search_runs([experiment.experiment_id])
    assert run.data.metrics and all("/" in name for name in run.data.metrics), sorted(run.data.metrics)


def test_a_chart_that_does_not_draw_the_run_fails_the_check(metrics_page, store):
    """The check can fail: a metric this run never logged has no chart, and the train_loss chart does
    not pass for the run's losses in reverse order (same steps, same count, other values)."""
    train_loss = history(store, TRAIN_LOSS)
    assert_chart_draws(metrics_page, TRAIN_LOSS, train_loss)  # the page is drawn: not a race
    assert not history(store, NOT_LOGGED)
    with pytest.raises(AssertionError, match=f"no chart for {NOT_LOGGED}"):
        chart(metrics_page, NOT_LOGGED)
    backwards = [Metric(m.key, r.value, m.timestamp, m.step) for m, r in zip(train_loss, train_loss[::-1], strict=True)]
    with pytest.raises(AssertionError, match="px off a linear y axis|y axis runs the wrong way"):
        assert_chart_draws(metrics_page, TRAIN_LOSS, backwards)


def test_the_run_starts_when_training_does(store):
    """MLflow's Duration is the training's: the run's start is the trainer's, not the moment the new
    sqlite store first answered (seconds later, near the end of a short run)."""
    client = MlflowClient(tracking_uri=store)
    [run] = client.search_runs([client.get_experiment_by_name(EXPERIMENT).experiment_id])
    steps = [m.timestamp for m in history(store, TRAIN_LOSS)]
    assert run.info.start_time <= min(steps)
    assert run.info.end_time - run.info.start_time >= max(steps) - min(steps)
