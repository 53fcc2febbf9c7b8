"""The GPT: nanochat's architecture, written for CPU and CUDA alike.

- rotary position embeddings, no learned positions
- RMSNorm without parameters, QK-norm
- untied token embedding and LM head
- ReLU^2 MLP
- value embeddings on alternating layers, mixed into V through a learned per-head gate
- per-layer scalars mixing the residual stream with the first-layer input (x0)
- logit soft-capping
- per-layer sliding windows (pattern such as SSSL) done with SDPA on every device: the window
  is a boolean mask on CPU and CUDA alike, so a CPU run trains the same model a GPU run would.

Generation (`GPT.stream`) keeps a KV cache: the prompt is prefilled once, then each new token is
one position's forward over the cached keys and values of every layer.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .grad_target import linear
from .loss import softcapped_cross_entropy
from .relu_squared import relu_squared
from .rms_norm import rms_norm
from .rotary import apply_rotary, rotary_tables

LOGIT_SOFTCAP = 15.0
VE_GATE_CHANNELS = 32


@dataclass
class ModelConfig:
    vocab_size: int
    n_layer: int
    n_head: int
    n_embd: int
    seq_len: int
    window_pattern: str = "SSSL"

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def padded_vocab(self) -> int:
        # Pad for matmul efficiency only; sharding never needs divisibility by the world size.
        return ((self.vocab_size + 63) // 64) * 64


def model_config_from(depth: int, aspect_ratio: int, head_dim: int, vocab_size: int, seq_len: int,
                      window_pattern: str) -> ModelConfig:
    """nanochat's shape rule: width = depth * aspect_ratio, rounded up to whole heads."""
    base_dim = depth * aspect_ratio
    n_embd = ((base_dim + head_dim - 1) // head_dim) * head_dim
    return ModelConfig(vocab_size=vocab_size, n_layer=depth, n_head=n_embd // head_dim, n_embd=n_embd,
                       seq_len=seq_len, window_pattern=window_pattern)


def has_value_embedding(layer: int, n_layer: int) -> bool:
    # alternate layers, always including the last one
    return layer % 2 == (n_layer - 1) % 2


def layer_windows(cfg: ModelConfig) -> list[int]:
    """Attention window (in tokens) per layer; the last layer always sees the full context."""
    short = max(1, cfg.seq_len // 2)
    pattern = cfg.window_pattern
    windows = [cfg.seq_len if pattern[i % len(pattern)] == "L" else short for i in range(cfg.n_layer)]
    windows[-1] = cfg.seq_len
    return windows


def window_mask(seq_len: int, window: int, device: torch.device, start: int = 0) -> torch.Tensor | None:
    """Boolean keep-mask for causal attention limited to `window` past tokens, for the queries at
    positions start .. start + seq_len - 1 over the keys at 0 .. start + seq_len - 1 (start > 0:
    generation continuing from a KV cache); None = plain causal from position 0."""
    end = start + seq_len
    if start == 0 and window >= seq_len:
        return None
    i = torch.arange(start, end, device=device)[:, None]
    j = torch.arange(end, device=device)[None, :]
    return (j <= i) & (i - j < window)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.head_dim
        d = cfg.n_embd
        # The blocks call linear(x, layer.weight), not the modules: its backward can write the
        # weight's gradient into the optimizer's shared buffer (grad_target.py). So the layers
        # have no bias and no module hooks run.
        self.c_q = nn.Linear(d, d, bias=False)
        self.c_k = nn.Linear(d, d, bias=False)
        self.c_v = nn.Linear(d, d, bias=False)
        self.c_proj = nn.Linear(d, d, bias=False)
        self.ve_gate = nn.Linear(VE_GATE_CHANNELS, cfg.n_head, bias=False) if has_value_embedding(
            layer, cfg.n_layer) else None

    def forward(self, x, ve, cos, sin, mask, kv=None, start=0):
        B, T, _ = x.shape
        q = linear(x, self.c_q.weight).view(B, T, self.n_head, self.head_dim)
        k = linear(x, self.c_k.weight).view(B, T, self.n_head, self.head_dim)
        v = linear(x, self.c_v.weight).view(B, T, self.n_head, self.head_dim)
        if ve is not None:
            # gate in (0, 2), starting at 1 (zero-initialised weights): the model learns how
            # much of the token's value embedding each head mixes in
            gate = 2 * torch.sigmoid(linear(x[..., :VE_GATE_CHANNELS], self.ve_gate.weight))
            v = v + gate.unsqueeze(-1) * ve.view(B, T, self.n_head, self.head_dim)
        q, k = rms_norm(apply_rotary(q, cos, sin)), rms_norm(apply_rotary(k, cos, sin))
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if kv is not None:  # generation: these positions' keys and values join the cached ones before them
            end = start + T
            kv[0][:, :, start:end], kv[1][:, :, start:end] = k, v
            k, v = kv[0][:, :, :end], kv[1][:, :, :end]
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return linear(y.transpose(1, 2).reshape(B, T, -1), self.c_proj.weight)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=False)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=False)

    def forward(self, x):
        return linear(relu_squared(linear(x, self.c_fc.weight)), self.c_proj.weight)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)

    def forward(self, x, ve, cos, sin, mask, kv=None, start=0):
        x = x + self.attn(rms_norm(x), ve, cos, sin, mask, kv, start)
        return x + self.mlp(rms_norm(x))


class KVCache:
    """Generation's memory: per layer, the keys (after rotary and QK-norm) and values of the first
    `pos` positions of the context, with room for the model's whole context (seq_len)."""

    def __init__(self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype):
        shape = (1, cfg.n_head, cfg.seq_len, cfg.head_dim)
        self.layers = [(torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype))
                       for _ in range(cfg.n_layer)]
        self.pos = 0


def kept_context(seq_len: int) -> int:
    """Tokens the context keeps when a new one would overflow it: the newest half."""
    return max(1, seq_len // 2)


def sample_token(logits: torch.Tensor, temperature: float, top_k: int, gen: torch.Generator) -> int:
    """The next token from one position's logits: the likeliest at temperature 0, else drawn from
    the softmax of logits / temperature over the top_k likeliest (0: over all)."""
    if temperature <= 0:
        return int(logits.argmax())
    ids = None
    if top_k > 0:
        logits, ids = torch.topk(logits, min(top_k, logits.numel()))
    choice = int(torch.multinomial(F.softmax(logits / temperature, -1), 1, generator=gen))
    return choice if ids is None else int(ids[choice])


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        V, d = cfg.padded_vocab, cfg.n_embd
        self.wte = nn.Embedding(V, d)
        self.blocks = nn.ModuleList([Block(cfg, i) for i in range(cfg.n_layer)])
        self.value_embeds = nn.ModuleDict(
            {str(i): nn.Embedding(V, d) for i in range(cfg.n_layer) if has_value_embedding(i, cfg.n_layer)})
        self.lm_head = nn.Linear(d, V, bias=False)
        self.resid_lambdas = nn.Parameter(torch.ones(cfg.n_layer))
        self.x0_lambdas = nn.Parameter(torch.zeros(cfg.n_layer))
        cos, sin = rotary_tables(cfg.seq_len, cfg.head_dim)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.windows = layer_windows(cfg)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        d = self.cfg.n_embd
        bound = math.sqrt(3.0) * d ** -0.5  # uniform with std 1/sqrt(d)

        def uniform_(p: torch.Tensor, lo: float, hi: float) -> None:
            p.copy_(torch.rand(p.shape, generator=gen) * (hi - lo) + lo)

        self.wte.weight.copy_(torch.randn(self.wte.weight.shape, generator=gen))
        self.lm_head.weight.copy_(torch.randn(self.lm_head.weight.shape, generator=gen) * 0.001)
        for block in self.blocks:
            for lin in (block.attn.c_q, block.attn.c_k, block.attn.c_v, block.mlp.c_fc):
                uniform_(lin.weight, -bound, bound)
            # zero output projections: every block starts as the identity
            block.attn.c_proj.weight.zero_()
            block.mlp.c_proj.weight.zero_()
            if block.attn.ve_gate is not None:
                block.attn.ve_gate.weight.zero_()
        for emb in self.value_embeds.values():
            uniform_(emb.weight, -bound, bound)
        self.resid_lambdas.fill_(1.0)
        self.x0_lambdas.fill_(0.1)

    @staticmethod
    def embed(table: nn.Embedding, idx: torch.Tensor) -> torch.Tensor:
        """A table lookup whose gradient is sparse: the rows of the tokens seen, not a dense
        (vocab x dim) tensor that is mostly zeros (the optimizer adds the rows into its own
        gradient buffer). Compiled graphs keep the dense form, which the compiler supports."""
        sparse = torch.is_grad_enabled() and not torch.compiler.is_compiling()
        return F.embedding(idx, table.weight, sparse=sparse)

    def hidden(self, idx: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """The residual stream after the last block, normed. With a cache, idx continues the
        cache's `pos` positions, whose keys and values it reuses, and its own join them."""
        B, T = idx.shape
        start = cache.pos if cache is not None else 0
        dtype = self.wte.weight.dtype
        cos, sin = self.cos[:, start:start + T].to(dtype), self.sin[:, start:start + T].to(dtype)
        masks = {w: window_mask(T, w, idx.device, start) for w in set(self.windows)}
        x = x0 = rms_norm(self.embed(self.wte, idx))
        for i, block in enumerate(self.blocks):
            x = self.resid_lambdas[i] * x + self.x0_lambdas[i] * x0
            ve = self.embed(self.value_embeds[str(i)], idx) if str(i) in self.value_embeds else None
            kv = cache.layers[i] if cache is not None else None
            x = block(x, ve, cos, sin, masks[self.windows[i]], kv, start)
        if cache is not None:
            cache.pos += T
        return rms_norm(x)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        head = self.lm_head.weight[: self.cfg.vocab_size]  # padded rows never score
        return LOGIT_SOFTCAP * torch.tanh((x @ head.t()).float() / LOGIT_SOFTCAP)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                reduction: str = "mean") -> torch.Tensor:
        x = self.hidden(idx)
        if targets is None:
            return self.logits(x)
        return softcapped_cross_entropy(x.reshape(-1, x.size(-1)), self.lm_head.weight, targets.reshape(-1),
                                        LOGIT_SOFTCAP, reduction, vocab=self.cfg.vocab_size)

    @torch.no_grad()
    def stream(self, prompt: Sequence[int], max_tokens: int, temperature: float = 0.0, top_k: int = 0,
               seed: int = 0, kv_cache: bool = True) -> Iterator[int]:
        """Sampled token ids, one at a time (see sample_token; `seed` seeds the draws).

        The context rule, the same with the KV cache and without it, so both give the same tokens:
        the model reads at most seq_len tokens; a longer prompt keeps its newest seq_len; when a new
        token would overflow the context, the context is cut to its newest half (kept_context) and
        read anew from position 0, as every training row starts at position 0. The cache is then
        prefilled again: one forward over seq_len / 2 tokens per seq_len / 2 new ones, where sliding
        the context by one token would re-read the whole context (rotary positions shift) every token.
        """
        if not prompt:
            raise ValueError("generation needs a prompt of at least one token (BOS)")
        device = self.wte.weight.device
        gen = torch.Generator(device=device).manual_seed(seed)
        seq_len = self.cfg.seq_len
        context = list(prompt[-seq_len:])
        cache = KVCache(self.cfg, device, self.wte.weight.dtype) if kv_cache else None
        for _ in range(max_tokens):
            unread = context[cache.pos:] if cache is not None else context
            x = self.hidden(torch.tensor([unread], dtype=torch.long, device=device), cache)
            token = sample_token(self.logits(x[0, -1]), temperature, top_k, gen)
            yield token
            context.append(token)
            if len(context) > seq_len:
                context = context[-kept_context(seq_len):]
                if cache is not None:
                    cache.pos = 0

    def generate(self, prompt: Sequence[int], max_tokens: int, temperature: float = 0.0, seed: int = 0,
                 top_k: int = 0, kv_cache: bool = True) -> list[int]:
        return list(self.stream(prompt, max_tokens, temperature, top_k, seed, kv_cache))


def parameter_groups(model: GPT) -> dict[str, list[nn.Parameter]]:
    """The optimizer's view of the model: Muon takes the 2-D block matrices, AdamW the rest."""
    gates = [b.attn.ve_gate.weight for b in model.blocks if b.attn.ve_gate is not None]
    gate_ids = {id(g) for g in gates}
    matrices = [p for p in model.blocks.parameters() if id(p) not in gate_ids]
    return {
        "matrix": matrices,
        "embedding": [model.wte.weight],
        "value_embedding": [e.weight for e in model.value_embeds.values()],
        "lm_head": [model.lm_head.weight],
        "scalar": [model.resid_lambdas, model.x0_lambdas] + gates,
    }


def parameter_breakdown(model: GPT) -> dict[str, int]:
    groups = parameter_groups(model)
    out = {name: sum(p.numel() for p in ps) for name, ps in groups.items()}
    out["total"] = sum(p.numel() for p in model.parameters())
    return out


def flops_per_token(model: GPT) -> int:
    """Training FLOPs per token: 6 x (non-embedding params) + attention, windows accounted.

    Embedding lookups (token and value embeddings) are gathers, not matmuls, so they are not
    counted; the LM head is. Attention score/value matmuls cost 12 x head_dim x n_head per
    attended position; a sliding-window layer attends to at most `window` positions.
    """
    cfg = model.cfg
    breakdown = parameter_breakdown(model)
    dense = breakdown["total"] - breakdown["embedding"] - breakdown["value_embedding"]
    attended = sum(min(w, cfg.seq_len) for w in model.windows)
    return 6 * dense + 12 * cfg.n_head * cfg.head_dim * attended
