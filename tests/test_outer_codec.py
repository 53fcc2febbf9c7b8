"""The outer syncs' codec (outer_codec.py) and its error feedback, with no process group; its use
in real outer syncs across torchrun nodes is test_local_steps.py."""

from __future__ import annotations

import pytest
import torch

from nanochat_cpu.outer_codec import BlockCodec, codec_named, send_with_feedback
from nanochat_cpu.sync_diloco import DiLoCo, Nodes, merge_outer_states

CODECS = [codec_named("int8"), codec_named("int4")]


def scale_rounding(codec: BlockCodec) -> float:
    """How far the scale as sent may stand from the block's largest over the levels: bf16's
    half unit in the last place, 2^-8 (none for fp32 scales, up to the division's own rounding)."""
    return 2.0 ** -8 if codec.scale_dtype == torch.bfloat16 else 1e-6


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.name)
def test_each_value_decodes_within_half_a_quantum_of_its_blocks_scale(codec):
    gen = torch.Generator().manual_seed(0)
    block = codec.block
    # rows not a whole number of blocks, blocks of very different sizes, an all-zero block
    x = torch.randn(3, 5 * block + 17, generator=gen) * torch.logspace(-6, 2, 5 * block + 17)
    x[1, block: 2 * block] = 0
    payload = codec.encode(x)
    assert payload.dtype == torch.uint8 and payload.shape == (3, codec.row_bytes(x.size(1)))
    got = codec.decode(payload, x.size(1))
    padded = torch.nn.functional.pad(x, (0, 6 * block - x.size(1))).view(3, 6, block)
    half_quantum = (padded.abs().amax(dim=2, keepdim=True) / codec.levels / 2).expand(-1, -1, block)
    bound = half_quantum.reshape(3, -1)[:, : x.size(1)]
    assert torch.all((got - x).abs() <= bound * (1 + 2 * scale_rounding(codec))), codec.name
    assert torch.equal(got[1, block: 2 * block], torch.zeros(block))
    # each block's largest value is sent as a whole level: exactly, but for the scale's own rounding
    top = x.abs().argmax(dim=1)
    assert torch.allclose(got[torch.arange(3), top], x[torch.arange(3), top], rtol=scale_rounding(codec))


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.name)
def test_every_level_packs_and_unpacks_exactly(codec):
    levels = torch.arange(-codec.levels, codec.levels + 1, dtype=torch.float32)
    x = levels.repeat(codec.block)[:codec.block * 2].view(1, -1)  # every block's largest is codec.levels: scale 1
    assert torch.equal(codec.decode(codec.encode(x), x.size(1)), x)


def test_bytes_on_the_wire():
    n = 256_000  # int8: 1,000 blocks of 256 and an fp32 scale each; int4: 8,000 of 32, a bf16 scale each
    assert [c.row_bytes(n) for c in CODECS] == [n + 4000, n // 2 + 16000]
    assert [c.row_bytes(n + 1) for c in CODECS] == [n + 256 + 4004, n // 2 + 16 + 16002]  # a block more
    assert [round(c.bytes_per_value, 4) for c in CODECS] == [1.0156, 0.5625]
    assert codec_named("none") is None and codec_named("int4").bits == 4


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.name)
def test_error_feedback_sends_the_sum_of_the_values_less_one_bounded_residual(codec):
    """Over K syncs the decoded payloads sum to the values' sum less the last residual, which
    stays within half a quantum of a block of values + residual; without feedback the rounding
    accumulates (a small steady value below half a quantum is never sent at all)."""
    gen = torch.Generator().manual_seed(1)
    block = codec.block
    n, steps = 8 * 256, 200
    drift = torch.full((1, n), 1e-3)  # below int4's half quantum of blocks whose largest is ~3
    residual = torch.zeros(n)
    sent_sum, true_sum, plain_sum = torch.zeros(1, n), torch.zeros(1, n), torch.zeros(1, n)
    for _ in range(steps):
        values = torch.randn(1, n, generator=gen) + drift
        true_sum += values
        plain_sum += codec.decode(codec.encode(values.clone()), n)
        payload = send_with_feedback(codec, values, residual)  # values now hold values + residual
        sent_sum += codec.decode(payload, n)
        bound = values.view(-1, block).abs().amax(dim=1, keepdim=True) / codec.levels / 2
        assert torch.all(residual.view(-1, block).abs() <= bound * (1 + 2 * scale_rounding(codec) + 1e-5))
    assert torch.allclose(sent_sum + residual, true_sum, atol=1e-3)
    fed = float((sent_sum - true_sum).abs().mean())
    plain = float((plain_sum - true_sum).abs().mean())
    assert fed < plain / 3, (codec.name, fed, plain)


def leader(index: int, count: int, model: torch.nn.Module, codec: BlockCodec | None) -> DiLoCo:
    """A node's first rank's outer optimizer, without a process group (state only)."""
    nodes = Nodes(index, [[r] for r in range(count)], None, None, index)
    return DiLoCo(model, nodes, 1 / count, 1.0, 0.0, torch.float32, torch.float32, shared_params=False, codec=codec)


def test_a_layout_change_keeps_the_sum_of_what_the_nodes_had_not_sent():
    """Three nodes' residuals merged for two: each new node carries half their sum (the nodes'
    deltas are summed, so the sum is what is still owed), and the owners' update residuals follow
    their slices as the momentum does, also into a run without a codec (which sends them with its
    next sync, once)."""
    model = torch.nn.Linear(37, 29)  # 1102 values: slices of 368 (3 nodes) and 551 (2)
    codec = codec_named("int4")
    gen = torch.Generator().manual_seed(2)
    old = [leader(i, 3, model, codec) for i in range(3)]
    for d in old:
        d.residual.normal_(generator=gen)
        d.update_residual.normal_(generator=gen)
        d.momentum.normal_(generator=gen)
    saved = [d.state_dict() for d in old]
    assert saved[0]["residual"].numel() == 1102 and saved[0]["update_residual"].numel() == 368
    whole = merge_outer_states(saved)
    owed = sum(d.residual[:1102] for d in old)
    updates = torch.cat([d.update_residual for d in old])
    for codec_now in (codec, None):
        new = [leader(i, 2, model, codec_now) for i in range(2)]
        for d in new:
            d.load_state_dict(whole)
        torch.testing.assert_close(sum(d.residual[:1102] for d in new), owed)
        assert torch.equal(torch.cat([d.update_residual for d in new])[:1102], updates[:1102])
        assert torch.equal(torch.cat([d.momentum for d in new])[:1102], whole["momentum"][:1102])
    # the same nodes resume their own residuals exactly
    again = leader(1, 3, model, codec)
    again.load_state_dict(saved[1])
    assert torch.equal(again.residual[:1102], old[1].residual[:1102])  # the padding's is always 0 in a run
    assert torch.equal(again.update_residual, old[1].update_residual)
