"""The model's size and cost as the banner reports them: the parameter breakdown against a
field report's numbers, and FLOPs per token (the MFU denominator) against counted FLOPs."""

from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from nanochat_cpu.config import TrainConfig
from nanochat_cpu.model import GPT, flops_per_token, model_config_from, parameter_breakdown


def test_parameter_breakdown_matches_the_field_report_at_depth_8():
    """Report 002 (upstream nanochat d8, vocab 32,768, seq 1,024) counted 125,829,354 parameters:
    wte 16.8M, value_embeds 67.1M (the bulk), lm_head 16.8M, block matrices 25.2M. Ours, with the
    default aspect ratio and head size, must be the same model; only the small scalar group
    (lambdas and value-embedding gates) may differ by a few hundred."""
    cfg = TrainConfig()
    mcfg = model_config_from(8, cfg.aspect_ratio, cfg.head_dim, 32768, 1024, cfg.window_pattern)
    with torch.device("meta"):  # shapes only: no 500 MB of weights
        parts = parameter_breakdown(GPT(mcfg))
    assert (mcfg.n_embd, mcfg.n_head) == (512, 4)
    assert parts["embedding"] == parts["lm_head"] == 32768 * 512 == 16_777_216
    assert parts["value_embedding"] == 4 * 32768 * 512 == 67_108_864  # every other layer of 8
    assert parts["matrix"] == 8 * 12 * 512 * 512 == 25_165_824  # attention 4 d^2 + MLP 8 d^2
    assert parts["total"] == sum(v for k, v in parts.items() if k != "total")
    assert abs(parts["total"] - 125_829_354) < 1_000


def test_flops_per_token_equals_the_counted_flops_of_a_training_step():
    """torch's FLOP counter over one forward and backward, attention through SDPA's math kernel
    (plain batched matmuls it can count), full windows: every matmul of the step is in the
    estimate. Only the element-wise scalars (residual lambdas) are in the estimate's 6 x N and
    not in the count."""
    mcfg = model_config_from(2, 32, 32, 512, 64, "L")
    model = GPT(mcfg)
    model.init_weights(0)
    tokens = torch.randint(0, 512, (1, 65), generator=torch.Generator().manual_seed(0))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(tokens[:, :-1], tokens[:, 1:]).backward()
    counted = counter.get_total_flops()
    estimate = flops_per_token(model) * 64
    scalars = parameter_breakdown(model)["scalar"]
    assert 0 <= estimate - counted <= 6 * scalars * 64, (estimate, counted)
    assert counted > 0.99 * estimate
