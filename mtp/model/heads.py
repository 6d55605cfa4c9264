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
    "PRE_NORM", "build_heads", "head_cache_layers",
]

#: Head types whose head i reads head i - 1's output and the token it predicts.
CASCADED = ("deepseek",)
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
    """Head 1 of the `deepseek` and `medusa1` types: the trunk output as it is (the main model's
    last block is the trunk's own)."""

    def forward(self, x, cos, sin, kv=None, slots=None, mask=None) -> torch.Tensor:
        return x


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


def _head(cfg: ModelConfig, i: int) -> nn.Module:
    if cfg.head_type == "block":
        return Block(cfg)
    if cfg.head_type == "linear":
        return LinearHead(cfg)
    if cfg.head_type == "medusa":
        return MedusaHead(cfg)
    if i == 0:
        return MainOutput()
    return MedusaHead(cfg, bias=True) if cfg.head_type == "medusa1" else DeepSeekModule(cfg)


def build_heads(cfg: ModelConfig) -> nn.ModuleList:
    """The K heads of `cfg.head_type`."""
    return nn.ModuleList(_head(cfg, i) for i in range(cfg.n_future))


def head_cache_layers(cfg: ModelConfig) -> list[int | None]:
    """Each head's layer of the KV cache, None where the head does not attend; the trunk's
    layers come first, then those of the heads that attend, in order."""
    attends = {"block": lambda i: True, "deepseek": lambda i: i > 0}.get(cfg.head_type,
                                                                         lambda i: False)
    layers, nxt = [], cfg.n_trunk_layers
    for i in range(cfg.n_future):
        layers.append(nxt if attends(i) else None)
        nxt += attends(i)
    return layers
