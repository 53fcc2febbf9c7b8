"""Upper bounds on every numeric trainer flag and the model shape they make: validate() alone,
as every rank runs it before rendezvous and the controller through `python -m nanochat_cpu.run_args`."""

from __future__ import annotations

import dataclasses

import pytest

from nanochat_cpu import config, run_args
from nanochat_cpu.config import ConfigError, TrainConfig, validate


def problem_of(**flags: object) -> ConfigError | None:
    try:
        validate(dataclasses.replace(TrainConfig(), **flags), world_size=1)
    except ConfigError as exc:
        return exc
    return None


def over(bound: float) -> float:
    return bound * 2 if isinstance(bound, float) else bound + 1


@pytest.mark.parametrize(("name", "bound"), [(k, b) for k, (b, _) in config.UPPER_BOUNDS.items()],
                         ids=list(config.UPPER_BOUNDS))
def test_each_flag_has_an_upper_bound_named_with_value_and_fix(name: str, bound: float) -> None:
    flag = "--" + name.replace("_", "-")
    exc = problem_of(**{name: over(bound)})
    assert exc is not None and exc.field == name
    assert str(exc).startswith(f"{flag}={over(bound)}: must be at most {bound:,} (")
    assert f"; fix: {flag} {bound} or less" in str(exc)
    at_bound = problem_of(**{name: bound})  # the bound itself is allowed (other rules may still object)
    assert at_bound is None or "must be at most" not in str(at_bound), at_bound


def test_every_numeric_flag_is_bounded() -> None:
    numeric = {f.name for f in dataclasses.fields(TrainConfig) if f.type in ("int", "float")}
    within_unit_range = {"warmup_ratio", "warmdown_ratio", "final_lr_frac", "outer_momentum",
                         "sync_warmup_ratio"}  # [0, 1] already
    assert numeric - within_unit_range == set(config.UPPER_BOUNDS)


def test_the_defaults_pass() -> None:
    assert problem_of() is None


def test_sync_every_is_bounded_but_auto_is_not() -> None:
    assert "--sync-every=10001: must be at most 10,000 (DiLoCo" in str(problem_of(sync_every="10001"))
    assert problem_of(sync_every="10000") is None and problem_of(sync_every="auto") is None


def test_a_rank_batch_size_is_bounded_like_device_batch_size() -> None:
    with pytest.raises(ConfigError, match=r"--rank-batch-sizes='2000,2': 2000 sequences for one rank, more than 1024 .*"
                                  r"fix: at most 1024 per rank"):
        config.explicit_rank_batch_sizes(dataclasses.replace(TrainConfig(), rank_batch_sizes="2000,2"), 2)


@pytest.mark.parametrize(("head_dim", "ok"), [(63, False), (127, False), (6, False), (2, False), (8, True),
                                              (64, True), (128, True), (256, True)])
def test_head_dim_must_be_even_and_in_range(head_dim: int, ok: bool) -> None:
    exc = problem_of(head_dim=head_dim)
    if ok:
        assert exc is None, exc
    else:
        assert exc is not None and exc.field == "head_dim"
        assert str(exc) == (f"--head-dim={head_dim}: must be an even number from 8 to 256 (rotary embeddings turn "
                            f"pairs of channels); fix: --head-dim 128 (nanochat's) or 64")


def test_head_dim_over_the_bound_is_named_as_too_large() -> None:
    assert str(problem_of(head_dim=258)).startswith("--head-dim=258: must be at most 256")


def test_a_model_too_wide_is_named_with_its_width_and_the_fix() -> None:
    exc = problem_of(depth=64, aspect_ratio=256)
    assert exc is not None and exc.field == "aspect_ratio"
    assert ("--aspect-ratio=256: makes model_dim = --depth 64 x --aspect-ratio 256, rounded up to whole heads of "
            "--head-dim 128, = 16384: more than 8192") in str(exc)
    assert "fix: --aspect-ratio 128 or less" in str(exc)
    assert problem_of(depth=64, aspect_ratio=128) is None


def test_a_model_too_narrow_for_the_value_embedding_gate_is_refused() -> None:
    exc = problem_of(depth=1, aspect_ratio=8, head_dim=8)
    assert exc is not None and "= 8: less than 32, the channels the value-embedding gate reads" in str(exc)
    assert problem_of(depth=2, aspect_ratio=16, head_dim=8) is None


@pytest.mark.parametrize(("depth", "aspect_ratio", "head_dim"), [(4, 64, 128), (2, 32, 32), (3, 50, 64), (1, 8, 48)])
def test_the_checked_width_is_the_model_s(depth: int, aspect_ratio: int, head_dim: int) -> None:
    from nanochat_cpu.model import VE_GATE_CHANNELS, model_config_from

    made = model_config_from(depth, aspect_ratio, head_dim, 256, 64, "SSSL")
    assert config.model_dim(depth, aspect_ratio, head_dim) == made.n_embd and made.n_embd % head_dim == 0
    assert config.MIN_MODEL_DIM == VE_GATE_CHANNELS


def test_the_controller_s_check_reports_a_bound_in_parts() -> None:
    verdict = run_args.check(["--depth", "100000"], world_size=1)
    assert (verdict["ok"], verdict["field"], verdict["value"]) == (False, "depth", "100000")
    assert verdict["problem"].startswith("must be at most 64 (") and "fix: --depth 64 or less" in verdict["problem"]


def test_outer_overlap_needs_local_steps() -> None:
    assert ("--outer-overlap=on: overlaps the outer syncs of local steps: it needs --sync-every above 1 or auto"
            in str(problem_of(outer_overlap="on")))
    assert problem_of(outer_overlap="on", sync_every="auto") is None
    assert problem_of(outer_overlap="on", sync_every="8") is None
    assert "is for CPU nodes" in str(problem_of(outer_overlap="on", sync_every="8", device="cuda"))
