"""The upstream side-by-side harness: what it asks of base_train and what it reads back.

Upstream itself is not here (no network in CI); a stand-in base_train that prints upstream's step
lines runs through the real harness: subprocess, environment, parsing, peak RSS, clean-up."""

from __future__ import annotations

import json
import re
import sys
import textwrap
from pathlib import Path

import pytest

from nanochat_cpu import upstream_bench
from nanochat_cpu.data import read_manifest, split_files
from nanochat_cpu.perf import cpu_model

# as upstream's base_train prints them (92d63d4), around other lines
LOG = """\
Vocab size: 32,768
step 00000/00006 (0.00%) | loss: 10.397 | lrm: 1.00 | dt: 31876.12ms | tok/sec: 514 | bf16_mfu: 0.01 | epoch: 1
step 00001/00006 (16.67%) | loss: 9.913 | lrm: 1.00 | dt: 1480.00ms | tok/sec: 11,070 | bf16_mfu: 0.01 | epoch: 1
step 00002/00006 (33.33%) | loss: 9.101 | lrm: 1.00 | dt: 1400.00ms | tok/sec: 11,702 | bf16_mfu: 0.01 | epoch: 1
step 00003/00006 (50.00%) | loss: 8.662 | lrm: 1.00 | dt: 1000.00ms | tok/sec: 16,384 | bf16_mfu: 0.01 | epoch: 1
step 00004/00006 (66.67%) | loss: 8.210 | lrm: 1.00 | dt: 2000.00ms | tok/sec: 8,192 | bf16_mfu: 0.01 | epoch: 1
Peak memory usage: 0.00MiB
"""


def test_step_lines_are_read_and_the_compile_steps_left_out():
    steps = upstream_bench.parse_steps(LOG.splitlines(keepends=True))
    assert [s[0] for s in steps] == [0, 1, 2, 3, 4]
    assert steps[1] == (1, 1.48, 11070)
    # steps 3 and 4: 2 x 16,384 tokens in 3 s (the mean of their printed rates would say 12,288)
    assert upstream_bench.summarize(steps, 16384) == {"tok_s": 10922.7, "steps_timed": 2, "first_step_s": 31.88}
    assert upstream_bench.summarize(steps[:3], 16384)["tok_s"] is None


def test_the_command_is_one_micro_step_of_the_shape_and_only_training():
    cmd = upstream_bench.base_train_command("py", *upstream_bench.SHAPES["d6-16k"], iterations=8)
    assert cmd[:3] == ["py", "-m", "scripts.base_train"]
    for flag in ("--depth=6", "--head-dim=64", "--window-pattern=L", "--max-seq-len=512", "--device-batch-size=32",
                 "--total-batch-size=16384", "--num-iterations=8", "--device-type=cpu", "--eval-every=-1",
                 "--core-metric-every=-1", "--sample-every=-1", "--save-every=-1"):
        assert flag in cmd


def test_shards_are_copied_under_upstreams_names_with_val_last(tiny_data_dir, tmp_path):
    base = tmp_path / "base"
    (base / "base_data_climbmix").mkdir(parents=True)
    (base / "base_data_climbmix" / "shard_09999.parquet").write_bytes(b"stale")
    copies = upstream_bench.copy_shards(tiny_data_dir, base)
    manifest = read_manifest(tiny_data_dir)
    names = split_files(manifest, "train") + split_files(manifest, "val")
    assert sorted(p.name for p in (base / "base_data_climbmix").iterdir()) == [p.name for p in copies]
    assert [p.name for p in copies] == [f"shard_{i:05d}.parquet" for i in range(len(names))]
    for name, copy in zip(names, copies, strict=True):
        assert copy.read_bytes() == (tiny_data_dir / name).read_bytes()


@pytest.fixture
def stand_in_upstream(tmp_path) -> Path:
    """A checkout whose base_train prints LOG, holds ~600 MiB, writes its final checkpoint, and
    records the environment it was given."""
    repo = tmp_path / "nanochat"
    (repo / "scripts").mkdir(parents=True)
    (repo / "scripts" / "__init__.py").write_text("")
    (repo / "scripts" / "base_train.py").write_text(textwrap.dedent(f"""
        import json, os, sys
        held = bytearray(600 * 1024 * 1024)
        for i in range(0, len(held), 4096):
            held[i] = 1
        base = os.environ["NANOCHAT_BASE_DIR"]
        os.makedirs(os.path.join(base, "base_checkpoints", "{upstream_bench.MODEL_TAG}"))
        with open(os.path.join(base, "seen.json"), "w") as f:
            json.dump({{"argv": sys.argv[1:], "dtype": os.environ["NANOCHAT_DTYPE"],
                       "threads": os.environ["OMP_NUM_THREADS"]}}, f)
        print({LOG!r}, end="")
        """))
    return repo


def test_a_shape_runs_base_train_and_reports_its_speed_and_memory(stand_in_upstream, tmp_path, capsys):
    base = tmp_path / "base"
    ballast = b"\1" * (1 << 30)  # this process at 1 GiB more: Linux hands a spawned child its parent's peak
    rc = upstream_bench.main(["--upstream", str(stand_in_upstream), "--python", sys.executable, "--base-dir",
                              str(base), "--shape", "d4-1k", "--threads", "2"])
    del ballast
    assert rc == 0
    out = capsys.readouterr().out
    result = json.loads(out.split("UPSTREAM ", 1)[1])
    assert result["tok_s"] == 682.7 and result["steps_timed"] == 2 and result["rc"] == 0  # 2 x 1,024 in 3 s
    # the child's own: its 600 MiB and an interpreter without torch, not this process's 1 GiB and more
    assert 600 <= result["peak_rss_mib"] < 700
    assert result["shape"] == "d4-1k" and result["iterations"] == 20 and result["cpu"] == cpu_model()
    seen = json.loads((base / "seen.json").read_text())
    assert "--depth=4" in seen["argv"] and seen["dtype"] == "float32" and seen["threads"] == "2"
    assert not (base / "base_checkpoints" / upstream_bench.MODEL_TAG).exists()  # its final checkpoint, deleted


def test_a_directory_without_base_train_is_refused_by_name(tmp_path, capsys):
    with pytest.raises(SystemExit):
        upstream_bench.main(["--upstream", str(tmp_path)])
    assert f"--upstream {tmp_path}: no scripts/base_train.py there" in capsys.readouterr().err


def test_pairs_give_the_median_ratio_and_memory_at_its_least_favourable():
    pairs = [{"shape": "d6-16k", "upstream_tok_s": u, "ours_tok_s": o, "ratio": r, "upstream_peak_rss_mib": ur,
              "ours_peak_rss_mib": orr}
             for u, o, r, ur, orr in [(700.0, 910.0, 1.3, 8400, 6700), (640.0, 920.0, 1.438, 8390, 7650),
                                      (780.0, 930.0, 1.192, 8470, 6810), (None, 900.0, None, 0, 6800)]]
    summary = upstream_bench.summarize_pairs(pairs)
    assert summary == {"shape": "d6-16k", "pairs": 3, "failed": 1, "ratio_median": 1.3, "ratio_min": 1.192,
                       "ratio_max": 1.438, "upstream_tok_s_median": 700.0, "ours_tok_s_median": 920.0,
                       "upstream_peak_rss_mib_median": 8400, "ours_peak_rss_mib_median": 6810,
                       "upstream_peak_rss_mib_min": 8390, "ours_peak_rss_mib_max": 7650}
    assert upstream_bench.summarize_pairs(pairs[3:]) == {"shape": "d6-16k", "pairs": 0, "failed": 1}


def test_pairs_run_both_back_to_back_in_alternating_order(stand_in_upstream, tmp_path, capsys, monkeypatch):
    # ours: a stand-in for bench that prints its result line as bench does, after a line of its own
    # at a shape's tokens a second: 1.5x the stand-in upstream's (2 steps of them in 3 s)
    stand_in_bench = ("import json, sys; print('a worker line'); "
                      "tokens = sys.argv[sys.argv.index('--total-batch-size') + 1]; "
                      "print(json.dumps({'tok_per_s': float(tokens), 'peak_rss_mib_per_rank': 500.0}))")
    commands, real_command = [], upstream_bench.ours_command

    def ours_command(name, steps, threads):
        commands.append(real_command(name, steps, threads))
        return [sys.executable, "-c", stand_in_bench, *commands[-1][3:]]

    monkeypatch.setattr(upstream_bench, "ours_command", ours_command)
    calls = []
    for side, name in (("upstream", "run_shape"), ("ours", "run_ours")):
        real = getattr(upstream_bench, name)
        monkeypatch.setattr(upstream_bench, name, lambda *a, side=side, real=real: calls.append(side) or real(*a))
    rc = upstream_bench.main(["--upstream", str(stand_in_upstream), "--python", sys.executable, "--base-dir",
                              str(tmp_path / "base"), "--shape", "d4-1k", "--shape", "d6-16k", "--pairs", "2",
                              "--threads", "2"])
    assert rc == 0
    assert calls == ["upstream", "ours"] * 2 + ["ours", "upstream"] * 2  # round 2 swaps who goes first
    # ours times as many steps as upstream's run does: 20 iterations at 1,024 tokens, 8 at 16,384, from step 3 on
    for cmd, depth, tokens, steps in zip(commands[:2], ("4", "6"), ("1024", "16384"), ("17", "5"),
                                         strict=True):
        assert cmd[cmd.index("--depth") + 1] == depth and cmd[cmd.index("--total-batch-size") + 1] == tokens
        assert cmd[cmd.index("--steps") + 1] == steps and cmd[cmd.index("--compile") + 1] == "off"
        assert cmd[cmd.index("--cores") + 1] == "2"
    out = capsys.readouterr().out
    pairs = [json.loads(line[5:]) for line in out.splitlines() if line.startswith("PAIR ")]
    assert [(p["round"], p["shape"], p["first"]) for p in pairs] == [
        (1, "d4-1k", "upstream"), (1, "d6-16k", "upstream"), (2, "d4-1k", "ours"), (2, "d6-16k", "ours")]
    assert pairs[0]["ratio"] == 1.5 and pairs[0]["upstream_tok_s"] == 682.7 and pairs[0]["ours_tok_s"] == 1024
    # and each side's whole result, for a pair that stands out
    ours = [json.loads(line[5:]) for line in out.splitlines() if line.startswith("OURS ")]
    upstream = [json.loads(line[9:]) for line in out.splitlines() if line.startswith("UPSTREAM ")]
    assert len(ours) == len(upstream) == 4 and ours[0]["peak_rss_mib_per_rank"] == 500.0
    assert upstream[1]["shape"] == "d6-16k" and upstream[1]["steps_timed"] == 2
    summaries = {s["shape"]: s for s in (json.loads(line[6:]) for line in out.splitlines()
                                         if line.startswith("PAIRS "))}
    assert summaries["d4-1k"]["pairs"] == 2 and summaries["d4-1k"]["ratio_median"] == 1.5
    # the stand-in upstream holds 600 MiB and more, the stand-in bench reports 500
    assert re.search(r"^\| d6-16k \| 2 \| 1\.50× \(1\.50-1\.50\) \| 10922\.7 / 16384\.0 \| 6\d\d(\.\d)? / 500\.0 "
                     r"\| 6\d\d / 500\.0 \|$", out, re.M)


def test_a_failed_run_of_ours_fails_the_pairs(stand_in_upstream, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(upstream_bench, "ours_command", lambda *a: [sys.executable, "-c", "raise SystemExit(3)"])
    rc = upstream_bench.main(["--upstream", str(stand_in_upstream), "--python", sys.executable, "--base-dir",
                              str(tmp_path / "base"), "--shape", "d4-1k", "--pairs", "1"])
    assert rc == 1
    pair = json.loads(capsys.readouterr().out.split("PAIR ", 1)[1].splitlines()[0])
    assert pair["ratio"] is None and pair["rc"] == 3
