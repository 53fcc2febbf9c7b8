"""How an outer sync's numbers travel: as they are (bf16 or fp32), or quantized per block.

`--outer-compress int8|int4` sends each outer sync's two halves (the nodes' weighted deltas
in the all-to-all, the owners' updates in the all-gather) as integers of that many bits, one
scale per block of values (int8: an fp32 scale per 256 values; int4: a bf16 scale per 32):

    scale = max |x| over the block / L        (L = 2^(bits-1) - 1: 127, 7; rounded to the scale's dtype)
    q     = round(x / scale)                  (in -L..L, stored as q + L in `bits` bits, packed)
    x'    = q * scale                         (what the receiver adds)

Per value on the wire that is 1.016 and 0.5625 bytes, against bf16's 2. Fifteen levels are coarse
next to a block's spread: with 256 values a block, a Gaussian's largest is ~2.9 of its standard
deviations, one level 0.41 of them, and the rounding dropped 12.7% of the values' norm (25% for a
Student-t with 3 degrees of freedom, heavier-tailed); 32 values a block drop 9.7% (13%) for 9%
more bytes, and a bf16 scale (8 bits of mantissa: the grid is off by under 0.4%) keeps the scales
at 2 bytes.
Two bits (ternary: -1, 0, +1 times the block's scale) were measured and dropped: at depth 4, 2M
tokens and H = 54 the run ended 25% above the uncompressed one's val bpb (docs/BENCHMARKS.md).
A block's scale follows its own largest value, so the deltas of a layer with small weights keep
their resolution beside one with large.

What a quantizer drops is not thrown away: error feedback (`send_with_feedback`) keeps it and adds it to
the next sync's value before quantizing, so over K syncs what was sent sums to what should have
been, less one residual that stays under half a quantum per value (INTELLECT-1 ran int8 outer
syncs; MuLoCo and SparseLoCo send 2-bit and sparse deltas with error feedback at DiLoCo's quality).
The sender keeps one residual per half: each node for its delta, each owner for its slice's
updates. Every node decodes the same bytes with the same arithmetic (an fp32 multiply, rounded
alike by any IEEE CPU), so theta_global stays bit-identical across nodes.

`encode` and `decode` work on rows (a row per destination: the all-to-all's slices), each padded
to whole blocks inside the payload, so the outer state's slices are laid out as without a codec.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class BlockCodec:
    """Symmetric round-to-nearest quantization to `bits` bits, one scale (`scale_dtype`) per `block`
    values."""

    def __init__(self, bits: int, block: int, scale_dtype: torch.dtype):
        assert bits in (4, 8) and block % (8 // bits) == 0, (bits, block)
        self.bits = bits
        self.block = block
        self.scale_dtype = scale_dtype
        self.scale_bytes = torch.finfo(scale_dtype).bits // 8
        self.levels = (1 << (bits - 1)) - 1  # the largest |q|
        self.per_byte = 8 // bits
        self.shifts = torch.arange(self.per_byte, dtype=torch.uint8) * bits

    @property
    def name(self) -> str:
        return f"int{self.bits}"

    @property
    def bytes_per_value(self) -> float:
        """On the wire, with the scales, for whole blocks."""
        return 1 / self.per_byte + self.scale_bytes / self.block

    def row_bytes(self, n: int) -> int:
        """Bytes on the wire for a row of `n` values: the packed values, then the blocks' scales."""
        blocks = -(-n // self.block)
        return blocks * self.block // self.per_byte + self.scale_bytes * blocks

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 rows [r, n] -> uint8 rows [r, row_bytes(n)]."""
        rows, n = x.shape
        blocks = -(-n // self.block)
        x = F.pad(x, (0, blocks * self.block - n)).view(rows, blocks, self.block)
        # quantized against the scale as sent, so sender and receivers decode alike
        scale = x.abs().amax(dim=2, keepdim=True).div_(self.levels).to(self.scale_dtype)
        # an all-zero block has scale 0: divide by the smallest normal instead, every q is then 0
        q = torch.div(x, scale.float().clamp_min_(torch.finfo(torch.float32).tiny)).round_()
        q = q.clamp_(-self.levels, self.levels).add_(self.levels).to(torch.uint8).view(rows, -1, self.per_byte)
        packed = q[..., 0].clone()
        for i in range(1, self.per_byte):
            packed.bitwise_or_(q[..., i].bitwise_left_shift(i * self.bits))
        return torch.cat([packed, scale.view(rows, blocks).contiguous().view(torch.uint8)], dim=1)

    def decode(self, payload: torch.Tensor, n: int) -> torch.Tensor:
        """uint8 rows [r, row_bytes(n)] -> fp32 rows [r, n]: q * scale."""
        rows = payload.size(0)
        blocks = -(-n // self.block)
        packed, scales = payload.split([blocks * self.block // self.per_byte, self.scale_bytes * blocks], dim=1)
        mask = (1 << self.bits) - 1
        q = packed.unsqueeze(-1).bitwise_right_shift(self.shifts.to(payload.device)).bitwise_and_(mask)
        values = q.view(rows, blocks, self.block).to(torch.float32).sub_(self.levels)
        values.mul_(scales.contiguous().view(self.scale_dtype).view(rows, blocks, 1).float())
        values = values.view(rows, blocks * self.block)
        return values if n == blocks * self.block else values[:, :n].contiguous()


CODECS = {"int8": BlockCodec(8, 256, torch.float32), "int4": BlockCodec(4, 32, torch.bfloat16)}


def codec_named(name: str) -> BlockCodec | None:
    """--outer-compress's codec; None for `none` (the values travel in --grad-comm-dtype and
    --param-comm-dtype, as every synchronous step's do)."""
    return CODECS.get(name)


def send_with_feedback(codec: BlockCodec, values: torch.Tensor, residual: torch.Tensor,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """Error feedback: the payload for `values` [r, n] plus `residual` (what the quantizer dropped
    from this sender's values before, fp32, as many values), and `residual` becomes what it drops
    now. `values` is overwritten (it holds values + residual after). Over K syncs the decoded
    payloads sum to the values' sum plus the residual before the first less the one after the last.
    A row at a time: the codec's temporaries stay a slice's size, not the model's. `out`: where the
    payload goes (the wire's buffer, viewed as rows), else a new tensor."""
    rows, n = values.shape
    payload = out if out is not None else torch.empty(rows, codec.row_bytes(n), dtype=torch.uint8,
                                                      device=values.device)
    for i, kept in enumerate(residual.view(rows, n)):
        carried = values[i: i + 1].add_(kept)
        payload[i: i + 1] = codec.encode(carried)
        torch.sub(carried[0], codec.decode(payload[i: i + 1], n)[0], out=kept)
    return payload
