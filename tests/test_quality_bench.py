"""nanochat_cpu.quality_bench's rows, checks, log reading, reuse and table; nothing here trains."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from nanochat_cpu.quality_bench import (
    Row,
    batch_problem,
    h_values,
    parse_args,
    plan,
    read_log,
    reusable,
    row_codec,
    row_names,
    settings_of,
    table,
    trainer_flags,
)

LOG = """[vm rank 0/3] step 00001/00002 loss=8.3 lrm=1.000 dt_ms=1500 tok_per_s=2048 mfu=1.0 compute_ms=1 optim_ms=1 \
comm_wait_ms=0
[vm rank 0/3] sync-every auto: H=12 (outer sync 0.40 s, slowest node's inner step 0.70 s: at most 5% ...)
[vm rank 0/3] outer step 1 at step 00002: sync_s=0.40 wait_s=0.10 pseudo_grad_norm=1.0000 sent_mb=20.0 H=12
[vm rank 0/3] step 00002/00002 loss=8.1 lrm=1.000 dt_ms=500 tok_per_s=6144 mfu=1.0 compute_ms=1 optim_ms=1 \
comm_wait_ms=0
[vm rank 0/3] eval step 00002 val_bpb=3.1234
"""


def test_rows_and_their_plan():
    assert row_names("alone,sync,08,auto") == ["alone", "sync", "8", "auto"]
    assert h_values("8,32,auto") == ["8", "32", "auto"]
    for bad in ("1", "0", "many"):
        with pytest.raises(argparse.ArgumentTypeError):
            h_values(bad)
    with pytest.raises(argparse.ArgumentTypeError):
        row_names("alone,solo")
    assert [plan(r, 3) for r in ("alone", "sync", "8", "auto")] == [(1, "1"), (3, "1"), (3, "8"), (3, "auto")]
    assert row_names("sync,away") == ["sync", "away"] and plan("away", 3) == (3, "1")  # synchronous, elastic
    # an H row's outer syncs compressed: the trainer gets --outer-compress, after any the benchmark passes on
    assert row_names("32:int8,08:int4") == ["32:int8", "8:int4"] and h_values("32,32:int4") == ["32", "32:int4"]
    assert plan("32:int8", 3) == (3, "32") and row_codec("32:int8") == "int8" and row_codec("32") is None
    for bad in ("32:int2", "sync:int8", "1:int8"):
        with pytest.raises(argparse.ArgumentTypeError):
            row_names(bad)
    flags = trainer_flags(parse_args(["--outer-compress", "int4"]), 10, "32", Path("/o"), compress="int8")
    assert flags[-4:] == ["--outer-compress", "int4", "--outer-compress", "int8"]
    assert "--outer-compress" not in trainer_flags(parse_args(["--outer-compress", "int4"]), 10, "1", Path("/o"))


def test_default_rows_steps_and_batch():
    args = parse_args([])
    assert args.rows == ["alone", "sync", "8", "32", "auto"]
    assert args.total_batch_size % (args.device_batch_size * args.seq * args.nodes) == 0


def test_batch_must_split_over_every_rows_ranks():
    assert batch_problem(["alone", "sync"], 3, 2, 256, 3072) == ""
    problem = batch_problem(["alone", "sync"], 3, 2, 256, 2048)
    assert "2 x 256 x 3 = 1536 (the 3-node rows" in problem and "Nearest valid: 1536 or 3072" in problem
    assert batch_problem(["alone"], 3, 2, 256, 2048) == ""  # the alone row only needs 2 x 256
    assert "(the alone row)" in batch_problem(["alone"], 3, 2, 256, 1000)


def test_refused_before_anything_runs(capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit):
        parse_args(["--total-batch-size", "2048"])
    assert "not divisible by" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--tokens", "20000", "--rows", "sync,8"])  # 7 steps: H = 8 would never sync
    assert "rows ['8'] would never sync" in capsys.readouterr().err


def test_trainer_flags_are_the_rows_only_difference(tmp_path: Path):
    args = parse_args(["--data-dir", "d", "--tokenizer-dir", "t"])
    sync, diloco = trainer_flags(args, 652, "1", tmp_path), trainer_flags(args, 652, "auto", tmp_path)
    assert [a for a, b in zip(sync, diloco, strict=True) if a != b] == ["1"]
    for pair in (["--eval-every", "0"], ["--resume", "never"], ["--dtype", "float32"], ["--compile", "off"]):
        assert sync[sync.index(pair[0]) + 1] == pair[1]
    assert "--outer-lr" not in sync  # the trainer's default unless given
    assert trainer_flags(parse_args(["--outer-lr", "0.5"]), 652, "8", tmp_path)[-2:] == ["--outer-lr", "0.5"]


def test_read_log_takes_the_final_eval_and_the_picked_h():
    found = read_log(LOG, "auto")
    assert found == {"val_bpb": 3.1234, "train_s": 2.0, "outer_syncs": 1, "h": 12}
    assert read_log(LOG, "8")["h"] == 8
    assert read_log(LOG, "1")["h"] is None
    assert read_log("", "auto")["val_bpb"] is None


def test_reuse_only_with_the_same_settings():
    args = parse_args(["--data-dir", "d", "--tokenizer-dir", "t"])
    settings = settings_of(args, 652)
    earlier = [vars(Row("sync", 3, "1", settings, val_bpb=2.5, tokens=2_002_944))]
    assert reusable(earlier, "sync", 3, settings).val_bpb == 2.5
    assert reusable(earlier, "sync", 4, settings) is None
    assert reusable(earlier, "sync", 3, {**settings, "depth": 8}) is None
    assert reusable(earlier, "alone", 3, settings) is None


def test_table_shows_the_cost_against_sync():
    rows = [Row("alone", 1, "1", {}, tokens=3072, val_bpb=2.49, wall_s=10.0, tok_per_s=2000),
            Row("sync", 3, "1", {}, tokens=3072, val_bpb=2.5, wall_s=9.0, tok_per_s=2500),
            Row("auto", 3, "auto", {}, h=12, tokens=3072, val_bpb=2.55, wall_s=8.0, tok_per_s=3000)]
    lines = table(rows)
    assert lines[0].startswith("| row | nodes | sync_every | H used | tokens | val_bpb | vs sync |")
    assert lines[2] == "| alone | 1 | 1 |  | 3,072 | 2.4900 | -0.40% | 10.0 | 2,000 |"
    assert lines[4] == "| auto | 3 | auto | 12 | 3,072 | 2.5500 | +2.00% | 8.0 | 3,000 |"
    assert table(rows[2:])[2].split(" | ")[6] == ""  # no sync row, no comparison


def test_the_away_row_says_how_long_and_what_went_on_meanwhile():
    away = {"left_at_step": 65, "back_at_step": 130, "away_s": 80.2, "away_share": 0.341, "steps_while_away": 66}
    rows = [Row("sync", 3, "1", {}, tokens=3072, val_bpb=2.5, wall_s=9.0, tok_per_s=2500),
            Row("away", 3, "1", {}, tokens=3072, val_bpb=2.51, wall_s=9.5, tok_per_s=2400, away=away)]
    lines = table(rows)
    assert lines[3] == "| away | 3 | 1 |  | 3,072 | 2.5100 | +0.40% | 9.5 | 2,400 |"
    assert lines[-1] == ("\naway: node 2 left at step 65 and came back at step 130, away 80.2 s (34% of the row's "
                         "wall time); the others trained 66 steps without it, until it was back in the group (a static "
                         "launch: none, waiting for it)")
