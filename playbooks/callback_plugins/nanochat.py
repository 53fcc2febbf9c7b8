"""ansible-playbook's screen output for this project: the default callback, with waits that say
something.

A task that polls (`until:` with `retries:`) prints one `FAILED - RETRYING` line per attempt in
the default callback: a run that trains for an hour fills the screen with hundreds of them and
no step, loss or time left. Here a retry prints
- the result's `progress` line when the task returns one (the run role's `run_progress` module:
  step, loss, tok/s, elapsed, ETA, val bpb), and only when it changed (the task's final result
  prints its line too, unless it is the host's line last shown, by this task or another);
- otherwise one `waiting:` line at the first retry and one every `quiet_retry_s` seconds after,
  saying how long it has waited and how many attempts are left. An async task's polls likewise.
A result that is only a message (`debug: msg=`, `fail: msg=`), a string or a list of strings, is
printed as those lines, four spaces in: the default YAML dump folds them at 80 columns, which
breaks the status table's columns and cuts the summary's lines in the middle. Everything else is
the default callback's output.
"""

from __future__ import annotations

import time

from ansible import constants as C
from ansible.plugins.callback.default import CallbackModule as DefaultCallback

DOCUMENTATION = """
    name: nanochat
    type: stdout
    short_description: the default output, with quiet waits and live run progress
    description:
      - The default stdout callback, except for retries of tasks that poll with until/retries, and
        results that are only a message, printed as plain lines.
      - A retry whose result carries C(progress) prints that line when it changed; any other retry
        prints one C(waiting:) line at first and then one every O(quiet_retry_s) seconds.
    extends_documentation_fragment:
      - default_callback
      - result_format_callback
    options:
      quiet_retry_s:
        description: Seconds between the C(waiting:) lines of one task on one host.
        type: int
        default: 60
        ini:
          - section: nanochat_callback
            key: quiet_retry_s
        env:
          - name: NANOCHAT_QUIET_RETRY_S
    requirements:
      - set as stdout_callback in ansible.cfg (this repository's does)
"""


class CallbackModule(DefaultCallback):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "stdout"
    CALLBACK_NAME = "nanochat"

    def __init__(self) -> None:
        super().__init__()
        self._last_progress: dict[str, str] = {}  # host -> the line last shown (by any task)
        self._waiting_since: dict[tuple[str, str], tuple[float, float]] = {}  # -> (first, last shown)

    def _dump_results(self, result: dict, indent=None, sort_keys=True, keep_invocation=False, serialize=True):
        shown = {k: v for k, v in result.items() if not k.startswith("_") and k not in ("changed", "failed")}
        msg = shown.get("msg")
        lines = [msg] if isinstance(msg, str) else msg
        if list(shown) != ["msg"] or not isinstance(lines, list) or not all(isinstance(x, str) for x in lines):
            return super()._dump_results(result, indent, sort_keys, keep_invocation, serialize)
        return "".join(f"\n    {line}" for text in lines for line in text.splitlines() or [""])

    def v2_runner_on_ok(self, result) -> None:
        """The last look of a polled task: its progress line too, unless the last retry showed it
        (a run that ended before the first look still gets its line)."""
        super().v2_runner_on_ok(result)
        self._show_progress(self.host_label(result), result.result.get("progress"))

    def v2_runner_retry(self, result) -> None:
        host = self.host_label(result)
        if self._show_progress(host, result.result.get("progress")):
            return
        left = result.result["retries"] - result.result["attempts"]
        self._say_waiting((host, result.task._uuid), host, f"{result.task_name or result.task} ({left} attempts left")

    def _show_progress(self, host: str, progress: str | None) -> bool:
        """Print the host's progress line if it changed; whether the result had one."""
        if progress and self._last_progress.get(host) != progress:
            self._last_progress[host] = progress
            self._display.display(f"  [{host}] {progress}", color=C.COLOR_OK)
        return bool(progress)

    def v2_runner_on_async_poll(self, result) -> None:
        """An async task's polls (the preflight's Gloo matrix, the wheelhouse download): throttled
        like retries, instead of an `ASYNC POLL` line per poll and host."""
        host = self.host_label(result)
        # each poll is a fresh async_status task: the job id is what stays the same
        job = result.result.get("ansible_job_id", "?")
        self._say_waiting((host, job), host, f"async job {job} of the task above (still running")

    def _say_waiting(self, key: tuple[str, str], host: str, what: str) -> None:
        now = time.monotonic()
        first, shown = self._waiting_since.get(key, (now, 0.0))
        if shown and now - shown < self.get_option("quiet_retry_s"):
            return
        self._waiting_since[key] = (first, now)
        waited = f", {now - first:.0f} s so far" if shown else ""
        self._display.display(f"waiting: [{host}]: {what}{waited})", color=C.COLOR_DEBUG)
