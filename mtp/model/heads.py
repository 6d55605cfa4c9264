"""The output heads: what each makes of the trunk output before the unembedding.

`--model.head_type` picks one design for all K heads (`heads[i]` predicts the token i + 1
positions ahead; head 1, the next token, is `heads[0]`):

- `block` (Gloeckle et al. 2024): a transformer block per head, every head reading the trunk
  output h. The paper's design.
- `linear`: a d x d map of h per head, the cheapest head with a weight of its own.
- `medusa` (Cai et al. 2024): a residual block h + SiLU(W_i h) per head. W_i starts at zero, so
  every head starts as the identity, as Medusa initialises its heads.
- `medusa1`: Medusa-1 as published and as vLLM serves it (`mtp export medusa`,
  `mtp.interop.vllm_medusa`).
  Head 1 is the main model's own output; head i > 1 is a residual block z + SiLU(W_i z + b_i)
  on the normalised trunk output z = norm(h), with no norm after it: unlike every other type,
  the shared norm comes before the heads (`MTPTransformer.head_input`), not after
  (`MTPTransformer.head_norm`). W_i and b_i start at zero, so every head starts as head 1.
- `deepseek` (DeepSeek-V3's MTP modules): heads in a chain. Head 1 is the main model's output
  itself; the trunk carries the one block more that `block` gives head 1, so with K = 1 both are
  the same model. Head i > 1 at position t reads head i - 1's output at t and the embedding of
  token t + i - 1, the token head i - 1 predicts. It RMS-normalises each, concatenates them,
  projects 2d -> d and runs one transformer block. The embedding is the trunk's own. Training
  feeds the true tokens (teacher forcing); drafting feeds each head the token drafted by the one
  before (`mtp.decoding.cascaded`).
- `eagle` (EAGLE, Li et al. 2024): heads 2..K are one layer, unrolled. Head 1 is the main model's
  output; head i > 1 at position t reads head i - 1's output at t and the embedding of token
  t + i - 1 (a DeepSeek module's inputs), and the step sits at position t + i - 2, the feature it
  predicts being that of the next position. Its attention sees the first step's cells up to t,
  whose features are the trunk's, and the chain's own earlier steps at t: what drafting sees,
  where the committed positions hold first steps and the drafts hold the chain
  (`EagleLayer.unrolled`, `mtp.decoding.eagle`). Training every step on the step before's own
  output is EAGLE-3's training-time test; weighting steps 3..K at zero trains the first alone,
  as EAGLE-1 does.

Parallel heads are called as head(h, cos, sin, kv, slots, mask) (`PRE_NORM` types: norm(h)),
cascaded ones as head(x, emb, cos, sin, kv, slots, mask): x is head i - 1's output, emb the
embedded tokens.
"""

from __future__ import annotations

import torch
from torch import nn

from mtp.config import HEAD_TYPES, ModelConfig
from mtp.model.layers import Block, RMSNorm

__all__ = [
    "CASCADED", "DeepSeekModule", "HEAD_TYPES", "LinearHead", "MainOutput", "MedusaHead",
    "PRE_NORM", "UNROLLED", "EagleLayer", "build_heads", "head_aliases", "head_cache_layers",
    "shift_rope",
]

#: Head types whose head i reads head i - 1's output and the token it predicts.
CASCADED = ("deepseek", "eagle")
#: Head types whose heads 2..K are one layer, unrolled (`EagleLayer`).
UNROLLED = ("eagle",)
#: Head types that read the trunk output after the shared norm, their outputs the normalised
#: hidden states themselves (no norm after the head).
PRE_NORM = ("medusa1",)


class LinearHead(nn.Module):
    """A d x d linear map of the trunk output (no residual, no norm of its own; the shared
    final norm follows): the cheapest head, one matrix per future offset."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x, cos, sin, kv=None, slots=None, mask=None) -> torch.Tensor:
        return self.proj(x)


class MedusaHead(nn.Module):
    """Medusa's residual block x + SiLU(W x + b), W (and b, with `bias`: `medusa1`) zero at
    initialisation (`reset_parameters`)."""

    def __init__(self, cfg: ModelConfig, bias: bool = False) -> None:
        super().__init__()
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=bias)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.proj.weight)
        if self.proj.bias is not None:
            nn.init.zeros_(self.proj.bias)

    def forward(self, x, cos, sin, kv=None, slots=None, mask=None) -> torch.Tensor:
        return x + nn.functional.silu(self.proj(x))


class MainOutput(nn.Module):
    """Head 1 of the `medusa1`, `deepseek` and `eagle` types: the trunk output as it is (the main
    model's last block is the trunk's own); of a trunk output with `--model.feature_layers`, the
    last block's part."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.d = cfg.d_model

    def forward(self, x, cos, sin, kv=None, slots=None, mask=None) -> torch.Tensor:
        return x[..., -self.d:]


class DeepSeekModule(nn.Module):
    """One DeepSeek-V3 MTP module: block(W [norm(x); norm(emb)]), W of shape d x 2d."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.hidden_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.embed_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.proj = nn.Linear(2 * cfg.d_model, cfg.d_model, bias=False)
        self.block = Block(cfg)

    def forward(self, x, emb, cos, sin, kv=None, slots=None, mask=None) -> torch.Tensor:
        u = self.proj(torch.cat([self.hidden_norm(x), self.embed_norm(emb)], dim=-1))
        return self.block(u, cos, sin, kv, slots, mask)


class EagleLayer(DeepSeekModule):
    """EAGLE's draft layer, DeepSeek's module in form, called once per step of the chain: a
    cached call is one step of drafting, `unrolled` every position's step at once in training.

    The first step reads the trunk output; with `--model.feature_layers` that is several blocks'
    outputs side by side, which `fuse` maps to one feature of width d (EAGLE-3), starting as the
    last block's output alone. Later steps read the step before's output.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        n = len(cfg.feature_layers)
        self.fuse = nn.Linear((n + 1) * cfg.d_model, cfg.d_model, bias=False) if n else None

    def reset_parameters(self) -> None:
        """`fuse` as the map to the last block's part: at first the layer reads what it reads
        without `--model.feature_layers`."""
        if self.fuse is not None:
            d = self.fuse.out_features
            with torch.no_grad():
                self.fuse.weight.zero_()[:, -d:] = torch.eye(d)

    def feature(self, x: torch.Tensor) -> torch.Tensor:
        """The feature (..., d) a step reads of x: the trunk output fused (the first step), or
        the step before's output as it is."""
        return x if self.fuse is None or x.shape[-1] == self.fuse.out_features else self.fuse(x)

    def forward(self, x, emb, cos, sin, kv=None, slots=None, mask=None) -> torch.Tensor:
        return super().forward(self.feature(x), emb, cos, sin, kv, slots, mask)

    def unrolled(self, x: torch.Tensor, emb: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 past: list[tuple[torch.Tensor, torch.Tensor]]):
        """One step at every position t of a window: inputs x and emb (B, T, d), the rotary
        tables of the step's positions, and `past`, the keys and values (B, Hkv, T, hd) of the
        steps before it. Returns the step's output (B, T, d) and its own keys and values.

        The step at t attends to the first step's cells at positions <= t (causal) and to each
        later step's cell at t alone (the diagonal), its own included: the cells a draft of the
        chain from t sees when decoding.
        """
        b = self.block
        x = self.feature(x)
        u = self.proj(torch.cat([self.hidden_norm(x), self.embed_norm(emb)], dim=-1))
        q, k, v = b.attn.project(b.attn_norm(u), cos, sin)
        if past:
            t = x.shape[1]
            keys = torch.cat([*(p[0] for p in past), k], dim=-2)  # (B, Hkv, (n + 1) T, hd)
            values = torch.cat([*(p[1] for p in past), v], dim=-2)
            eye = torch.eye(t, dtype=torch.bool, device=x.device)
            mask = torch.cat([torch.ones_like(eye).tril(), *[eye] * len(past)], dim=1)
            out = b.attn.attend(q, keys, values, mask)
        else:
            out = b.attn.attend(q, k, v, None)
        u = u + out
        return u + b.mlp(b.mlp_norm(u)), (k, v)


def shift_rope(cos: torch.Tensor, sin: torch.Tensor, table_cos: torch.Tensor,
               table_sin: torch.Tensor, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary tables of positions `offset` further on: cos(a + b) and sin(a + b) from those of
    a and of b = the offset's row of the tables (max_seq_len, hd / 2)."""
    c, s = table_cos[offset].to(cos), table_sin[offset].to(sin)
    return cos * c - sin * s, sin * c + cos * s


def _head(cfg: ModelConfig, i: int) -> nn.Module:
    if cfg.head_type == "block":
        return Block(cfg)
    if cfg.head_type == "linear":
        return LinearHead(cfg)
    if cfg.head_type == "medusa":
        return MedusaHead(cfg)
    if i == 0:
        return MainOutput(cfg)
    return MedusaHead(cfg, bias=True) if cfg.head_type == "medusa1" else DeepSeekModule(cfg)


def build_heads(cfg: ModelConfig) -> nn.ModuleList:
    """The K heads of `cfg.head_type`; for `eagle`, heads 2..K are one module."""
    if cfg.head_type in UNROLLED:
        layer = EagleLayer(cfg)
        return nn.ModuleList([MainOutput(cfg), *[layer] * (cfg.n_future - 1)])
    return nn.ModuleList(_head(cfg, i) for i in range(cfg.n_future))


def head_aliases(heads: nn.ModuleList) -> dict[int, int]:
    """Each head that is an earlier head's module (eagle's heads 3..K), to that head's index:
    what a writer of the weights stores once and a reader restores to every head."""
    first: dict[int, int] = {}
    return {i: first[id(h)] for i, h in enumerate(heads) if first.setdefault(id(h), i) != i}


def head_cache_layers(cfg: ModelConfig) -> list[int | None]:
    """Each head's layer of the KV cache, None where the head does not attend; the trunk's
    layers come first, then those of the heads that attend, in order."""
    if cfg.head_type in UNROLLED:  # one layer, one cache layer
        return [None] + [cfg.n_trunk_layers] * (cfg.n_future - 1)
    attends = {"block": lambda i: True, "deepseek": lambda i: i > 0}.get(cfg.head_type,
                                                                         lambda i: False)
    layers, nxt = [], cfg.n_trunk_layers
    for i in range(cfg.n_future):
        layers.append(nxt if attends(i) else None)
        nxt += attends(i)
    return layers
