"""The work split's arithmetic: rows per rank from measured speeds (the runs that time real ranks
are in test_train_runs.py)."""

import pytest

from nanochat_cpu.work_split import balanced_split, fixed_cost_rows


def test_whole_rows_go_where_the_slowest_rank_finishes_first():
    # the docstring's case: at speeds 1 : 0.5 : 1, 12 rows as 5,2,5 (0.42 s a row) beat 6 as 3,1,2 (0.5)
    assert balanced_split([1.0, 2.0, 1.0], 12, 6) == [5, 2, 5]
    assert balanced_split([1.0, 2.0, 1.0], 6, 3) == [3, 1, 2]  # 6 rows at most


def test_a_micro_batchs_fixed_cost_is_where_its_seconds_meet_zero_rows():
    assert fixed_cost_rows({4: 0.44, 2: 0.24}, 4) == pytest.approx(0.4)  # 0.1 s a row, 0.04 s a pass
    assert fixed_cost_rows({2: 0.24, 4: 0.44}, 4) == pytest.approx(0.4)  # in either order
    assert fixed_cost_rows({4: 0.40, 2: 0.19}, 4) == 0.0  # noise below zero rows
    assert fixed_cost_rows({4: 0.20, 2: 0.21}, 4) == 4.0  # the passes cost the same: all of it fixed, at most


def test_a_one_row_rank_judged_by_seconds_per_row_alone_keeps_too_few_rows():
    """Steps measured in CI: node 0 computed 7 rows in 783 ms and node 1 one row in 167 ms, both
    cores idle and equally fast. Per row alone node 1 looks 1.5x slower and gets 3 rows of 8; with
    the pass's fixed cost (half a row's time, as calibration measures it) the speeds are equal."""
    assert balanced_split([0.783 / 7, 0.167 / 1], 8, 8) == [5, 3]
    assert balanced_split([0.783 / 7.5, 0.167 / 1.5], 8, 8, fixed_rows=0.5) == [4, 4]


def test_a_fixed_cost_favours_fewer_larger_micro_batches():
    # two micro-steps of [1, 1] pay the fixed cost twice; one of [2, 2] once (the cap is 2 x 2 rows)
    assert balanced_split([1.0, 1.0], 4, 2, fixed_rows=0.0) == [1, 1]
    assert balanced_split([1.0, 1.0], 4, 2, fixed_rows=1.0) == [2, 2]


def test_no_more_micro_steps_than_the_even_split():
    """The demo's calibration on a busy host (3 ranks, 24 rows a step, 6 configured, speeds
    1 : 0.5 : 0.5) saw no fixed cost a micro-batch: 4 rows a micro-step scored as well as 8 or 12,
    and [2, 1, 1] in six passes was 10-20% slower a row in the steps than [4, 2, 2] in three.
    Micro-steps of fewer rows than the configured ones are not tried."""
    assert balanced_split([1.0, 2.0, 2.0], 24, 6, fixed_rows=0.0) == [4, 2, 2]
    assert balanced_split([1.0, 2.0, 2.0], 24, 6, fixed_rows=0.5) == [6, 3, 3]  # fewer passes where they cost
    assert balanced_split([1.0, 1.0, 1.0], 24, 6) == [2, 2, 2]  # equal speeds: the even split
