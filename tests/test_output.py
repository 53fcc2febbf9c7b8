"""What ansible-playbook prints with this repository's ansible.cfg: the stdout callback
(playbooks/callback_plugins/nanochat.py) and the run role's run_progress reading the trainer's
status file.

Real ansible-playbook runs on localhost. The polled progress comes from a module written here
that returns a `progress` line as run_progress does (the real module reads systemd, journald and
the run's status file, which only the molecule scenario's nodes have: molecule/common/verify_training.yml checks the
demo's screen there)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_roles import ROOT, env, tool

# a stand-in for run_progress: step N at the Nth poll, finished at the 4th
COUNTING_MODULE = '''#!/usr/bin/python
from ansible.module_utils.basic import AnsibleModule
module = AnsibleModule(argument_spec={"state_file": {"type": "str", "required": True}})
path = module.params["state_file"]
try:
    n = int(open(path).read()) + 1
except OSError:
    n = 1
open(path, "w").write(str(n))
step = min(n, 3) * 10  # the same line twice at the end: shown once
module.exit_json(changed=False, finished=n >= 5, progress=f"d4 step {step}/40 loss 6.1 | 900 tok/s | eta {40 - step}s")
'''


def play(tmp_path: Path, tasks: str, **extra_env: str) -> str:
    (tmp_path / "library").mkdir(exist_ok=True)
    (tmp_path / "library" / "counting_progress.py").write_text(COUNTING_MODULE)
    (tmp_path / "play.yml").write_text(
        "- hosts: localhost\n  connection: local\n  gather_facts: false\n  tasks:\n" + tasks)
    res = subprocess.run(
        [tool("ansible-playbook"), "-i", "localhost,", "-e", f"ansible_python_interpreter={sys.executable}",
         str(tmp_path / "play.yml")],
        cwd=ROOT, env={**env(), **extra_env}, capture_output=True, text=True, timeout=300,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout


def test_a_polled_progress_line_is_shown_when_it_changes_and_no_retry_wall(tmp_path: Path) -> None:
    out = play(tmp_path, f"""    - name: Follow
      counting_progress:
        state_file: {tmp_path / 'n'}
      register: r
      until: r.finished
      retries: 10
      delay: 1
""")
    assert "FAILED - RETRYING" not in out
    shown = [line.strip() for line in out.splitlines() if "d4 step" in line]
    assert shown == [f"[localhost] d4 step {s}/40 loss 6.1 | 900 tok/s | eta {40 - s}s" for s in (10, 20, 30)], out


def test_a_progress_task_done_at_its_first_look_still_shows_its_line(tmp_path: Path) -> None:
    (tmp_path / "n").write_text("9")  # finished at once: no retry
    out = play(tmp_path, f"""    - name: Follow
      counting_progress:
        state_file: {tmp_path / 'n'}
""")
    assert "\n  [localhost] d4 step 30/40 loss 6.1 | 900 tok/s | eta 10s\n" in out, out


def test_a_plain_retry_says_waiting_once_a_minute_not_every_attempt(tmp_path: Path) -> None:
    tasks = """    - name: Wait for something that never comes
      ansible.builtin.command: "true"
      register: r
      until: false
      retries: 4
      delay: 1
      failed_when: false
      changed_when: false
"""
    out = play(tmp_path, tasks)
    assert "FAILED - RETRYING" not in out
    assert out.count("waiting: [localhost]: Wait for something that never comes (") == 1, out
    # the throttle is what keeps it to one line: without it, a line per attempt
    out = play(tmp_path, tasks, NANOCHAT_QUIET_RETRY_S="0")
    assert out.count("waiting: [localhost]: Wait for something that never comes (") == 4, out


def test_async_polls_are_throttled_like_retries(tmp_path: Path) -> None:
    out = play(tmp_path, """    - name: A long job
      ansible.builtin.command: sleep 4
      async: 30
      poll: 1
      changed_when: false
""")
    assert "ASYNC POLL" not in out
    assert out.count("waiting: [localhost]: async job ") == 1, out


def test_a_message_prints_as_its_lines_unfolded(tmp_path: Path) -> None:
    row = "node0      0    d4         active/running   0   00012/00020 7.0118  2211   11s     2.9121"
    verdict = ("d4: FASTER THAN ONE NODE: cluster 2,802 tok/s with 3 ranks = 1.25x what rank 0@node0 would do "
               "alone (~2,242 tok/s, est.)")
    out = play(tmp_path, f"""    - name: Show a table
      ansible.builtin.debug:
        msg:
          - "{row}"
          - "{verdict}"
    - name: Show a value
      ansible.builtin.debug:
        var: ansible_version.major
""")
    assert f"\n    {row}\n    {verdict}\n" in out, out
    assert "ansible_version.major: 2" in out  # anything else: the default YAML dump


# ---- run_progress reads the trainer's status file --------------------------------------------------

def run_progress():
    spec = importlib.util.spec_from_file_location("run_progress", ROOT / "roles/run/library/run_progress.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def written_status(tmp_path, rank: int, **fields) -> str:
    """A status file as the trainer writes it: rank `rank` of 3, its node's first rank."""
    from nanochat_cpu.dist import DistEnv
    from nanochat_cpu.run_status import RunStatus

    env = DistEnv(rank=rank, local_rank=0, world_size=3, backend="gloo", host=f"node{rank}",
                  hosts=["node0", "node1", "node2"])
    tmp_path.mkdir(exist_ok=True)
    status = RunStatus(str(tmp_path), "d4", env, 40, writes=True, resumed=False)
    status.update(state="training", **fields)
    assert status.flush()
    return status.path


def test_run_progress_reads_the_status_file_the_trainer_writes(tmp_path) -> None:
    """The contract between nanochat_cpu/run_status.py and the role: the trainer's own writer, the
    role's own reader, and the cells status.yml's table shows (molecule asserts their form too)."""
    rp = run_progress()
    step = {"step": 21, "loss": 4.84871, "tok_per_s": 5907.8, "elapsed": "1.2m", "eta": "1.1m"}
    master = rp.read_status(written_status(tmp_path / "m", 0, **step))
    assert master["loss_of"] == "run" and master["members"] == ["node0", "node1", "node2"]
    p = rp.columns(master)
    assert p == {"step": 21, "total": 40, "percent": 52.5, "loss": "4.8487", "tok_s": "5908", "elapsed": "1.2m",
                 "eta": "1.1m", "val_bpb": None}
    assert rp.progress_line("d4", "active/running", "0", p) == (
        "d4 step 21/40 (52.5%) loss 4.8487 | 5908 tok/s | elapsed 1.2m eta 1.1m")
    p = rp.columns(rp.read_status(written_status(tmp_path / "m", 0, **step, val_bpb=2.91214, val_step=20)))
    assert rp.progress_line("d4", "active/running", "0", p).endswith("| val_bpb 2.9121")
    assert rp.progress_line("d4", "activating/auto-restart", "2", p).endswith(
        "| 2 restart(s) | activating/auto-restart")
    assert rp.progress_line("d4", "failed/failed", "0", p).endswith("| val_bpb 2.9121 | failed/failed")
    assert rp.progress_line("d4", "inactive/dead", "0", p).endswith("| val_bpb 2.9121")  # ended well
    worker = rp.read_status(written_status(tmp_path / "w", 1, **step))
    assert worker["loss_of"] == "this node's ranks" and rp.columns(worker)["loss"] == "4.8487"


def test_run_progress_before_the_first_step_and_on_what_is_not_the_trainers_file(tmp_path) -> None:
    rp = run_progress()
    assert rp.read_status(str(tmp_path / "status.json")) == {}
    secret = tmp_path / "secret.json"
    secret.write_text('{"root": "only"}')
    (tmp_path / "link.json").symlink_to(secret)  # the service user owns the run's directory
    assert rp.read_status(str(tmp_path / "link.json")) == {}
    (tmp_path / "big.json").write_text("[" + "0," * rp.MAX_STATUS_BYTES + "0]")
    assert rp.read_status(str(tmp_path / "big.json")) == {}
    (tmp_path / "list.json").write_text("[1]")
    assert rp.read_status(str(tmp_path / "list.json")) == {}
    assert rp.progress_line("d4", "active/running", "0", rp.columns({})) == "d4: active/running, no step yet"


def test_only_a_disks_writer_writes_and_a_typo_is_refused(tmp_path) -> None:
    from nanochat_cpu.dist import DistEnv
    from nanochat_cpu.run_status import RunStatus

    env = DistEnv(rank=1, local_rank=1, world_size=2, backend="gloo", host="node0", hosts=["node0", "node0"])
    second = RunStatus(str(tmp_path), "d4", env, 40, writes=False, resumed=False)
    second.update(step=1)
    assert second.path is None and second.flush() and not (tmp_path / "status.json").exists()
    with pytest.raises(KeyError, match="not a status field"):
        second.update(stepp=2)


def test_a_resumed_run_keeps_what_the_file_said_and_a_stuck_disk_holds_no_step(tmp_path, monkeypatch) -> None:
    """After a restart the last step, val bpb and verdict stay in view until newer ones (a fresh run
    of the same name starts empty); the file is written by a thread, so a disk that stops
    answering holds that thread and never the step that updates it."""
    import threading

    from nanochat_cpu.dist import DistEnv
    from nanochat_cpu.run_status import RunStatus

    rp = run_progress()
    path = written_status(tmp_path, 0, step=30, loss=4.5, val_bpb=2.5, val_step=30, verdict="FASTER THAN ONE NODE")
    env = DistEnv(rank=0, local_rank=0, world_size=3, backend="gloo", host="node0", hosts=["node0", "node1", "node2"])
    again = RunStatus(str(tmp_path), "d4", env, 40, writes=True, resumed=True)
    again.update(state="starting")
    assert again.flush()
    said = rp.read_status(path)
    assert (said["state"], said["step"], said["val_bpb"], said["verdict"]) == ("starting", 30, 2.5,
                                                                               "FASTER THAN ONE NODE")
    fresh = RunStatus(str(tmp_path), "d4", env, 40, writes=True, resumed=False)
    fresh.update(state="starting")
    assert fresh.flush() and rp.read_status(path)["step"] is None
    stuck = threading.Event()
    monkeypatch.setattr(RunStatus, "_write", lambda self, fields: stuck.wait(30))
    hung = RunStatus(str(tmp_path), "d4", env, 40, writes=True, resumed=False)
    t0 = time.monotonic()
    for step in range(1, 50):
        hung.update(state="training", step=step)
    assert time.monotonic() - t0 < 1.0 and hung.flush(timeout_s=0.2) is False
    stuck.set()
    assert hung.flush(timeout_s=5.0)


def test_run_progress_says_a_run_that_stopped_stepping_is_not_training(tmp_path) -> None:
    """A node's steps stop coming (a peer away, a group re-forming): the row says so, with no ETA.
    The bound is 5 of the run's own step times and at least a minute, so a slow step is not a stall."""
    rp = run_progress()
    status = rp.read_status(written_status(tmp_path, 0, step=21, loss=4.8, tok_per_s=900.0, step_s=2.0,
                                           elapsed="1.2m", eta="1.1m"))
    now = status["updated"]
    assert rp.phase("active/running", status, now + 59) == "training"
    assert rp.phase("active/running", status, now + 61) == "stalled, no step for 61s"
    slow = {**status, "step_s": 30.0}  # a big model on a slow node: 5 steps of its own before a stall
    assert rp.phase("active/running", slow, now + 149) == "training"
    assert rp.phase("active/running", {**status, "state": "stopped"}, now + 20) == "waiting for the group (20s)"
    assert rp.phase("activating/auto-restart", status, now) == "activating/auto-restart"
    assert rp.phase("active/running", {**status, "state": "done"}, now + 600) == "done"
    p = rp.columns(status)
    line = rp.progress_line("d4", "active/running", "0", p, "stalled, no step for 61s")
    assert line == "d4 step 21/40 (52.5%) loss 4.8000 | 900 tok/s | elapsed 1.2m eta - | stalled, no step for 61s"
    assert rp.progress_line("d4", "active/running", "0", p, "training").endswith("eta 1.1m")


def test_the_master_remembers_which_nodes_left_the_group_and_since_when(tmp_path) -> None:
    """An elastic run's status file lists the nodes out of the group that were in it, with the step
    and time of the last status written while they were; a node back in the group is off the list,
    and one gone through several re-formations keeps the step it was first found gone at."""
    from nanochat_cpu.dist import DistEnv
    from nanochat_cpu.run_status import RunStatus

    rp = run_progress()

    def group(places: list[int], step: int | None, resumed: bool = True) -> dict:
        env = DistEnv(rank=0, local_rank=0, world_size=len(places), backend="gloo", host="node0",
                      hosts=[f"node{p}" for p in places], nodes=places)
        status = RunStatus(str(tmp_path), "d4", env, 400, writes=True, resumed=resumed)
        status.update(state="training", step=step)
        assert status.flush()
        return rp.read_status(status.path)

    assert group([0, 1, 2], 30, resumed=False)["left"] == {}
    said = group([0, 1], 48)  # node2 left at the checkpoint of step 30's file
    assert said["nodes"] == [0, 1] and set(said["left"]) == {"2"} and said["left"]["2"]["step"] == 30
    said = group([0], 60)  # then node1, while node2 is still away
    assert said["left"]["2"]["step"] == 30 and said["left"]["1"]["step"] == 48
    said = group([0, 2], 61)  # node2 back
    assert set(said["left"]) == {"1"} and said["left"]["1"]["step"] == 48
    assert isinstance(said["left"]["1"]["time"], float)
