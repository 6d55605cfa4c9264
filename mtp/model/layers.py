"""The layers every part of the model is built from: RMSNorm, rotary embeddings, attention over
an optional KV cache, the SwiGLU MLP and the pre-norm block.

Dimension names: B batch, T new tokens, S cached slots, d width, H attention heads, Hkv key/value
heads, hd head width. A leading "..." is (B,) for one block and (J, B) for J blocks stacked by
`mtp.decoding.stacked.stack_blocks`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from mtp.config import ModelConfig

__all__ = ["Attention", "Block", "RMSNorm", "SwiGLU", "apply_rope", "rope_tables"]

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # At least fp32: under bf16 autocast the mean of squares loses too many bits.
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return out.type_as(x) * self.weight


def rope_tables(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosine and sine tables for rotary embeddings, each (max_seq_len, hd / 2), fp64.

    NOTE: kept in fp64 and cast per forward to max(fp32, compute dtype): fp32 angles at position
    4096 are off by ~2e-4 rad, and an fp64 model (used by the exactness tests) stays exact.
    """
    inv_freq = 1.0 / cfg.rope_theta ** (
        torch.arange(0, cfg.attn_head_dim, 2, dtype=torch.float64) / cfg.attn_head_dim)
    angles = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float64), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of channels of x (B, H, T, hd) by position; cos, sin are (B, 1, T, hd / 2)."""
    x1, x2 = x.to(cos.dtype).unflatten(-1, (-1, 2)).unbind(-1)  # (B, H, T, hd/2) each
    rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_q, self.n_kv, self.hd = cfg.n_attn_heads, cfg.attn_kv_heads, cfg.attn_head_dim
        self.qkv = nn.Linear(cfg.d_model, (self.n_q + 2 * self.n_kv) * self.hd, bias=cfg.attn_bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def project(self, x: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries (..., H, T, hd), keys and values (..., Hkv, T, hd) of x, rotated by position."""
        # Leading dimensions "..." are (B,) for one block and (J, B) for J stacked blocks
        # (`stack_blocks`), which run the same code with one weight per block.
        q, k, v = rearrange(self.qkv(x), "... t (h hd) -> ... h t hd", hd=self.hd).split(
            [self.n_q, self.n_kv, self.n_kv], dim=-3
        )  # (..., H, T, hd), (..., Hkv, T, hd) x 2
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor | None) -> torch.Tensor:
        """The output (..., T, d) of queries q over keys k and values v (causal without mask),
        computed in the keys' dtype and projected in the queries'."""
        out = F.scaled_dot_product_attention(
            q.to(k.dtype), k, v, attn_mask=mask, is_causal=mask is None,
            enable_gqa=self.n_kv != self.n_q
        )  # (..., H, T, hd)
        return self.proj(rearrange(out.to(q.dtype), "... h t hd -> ... t (h hd)"))

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor] | None = None,
        slots: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        q, k, v = self.project(x, cos, sin)
        if kv is not None:
            k_cache, v_cache = kv  # (..., Hkv, S, hd)
            idx = slots[..., None, :, None].expand(k.shape)  # slots (B, T) or (J, B, T)
            k_cache.scatter_(-2, idx, k.to(k_cache.dtype))
            v_cache.scatter_(-2, idx, v.to(v_cache.dtype))
            # Attend over the first S slots only, S = the mask's width: the caller knows how far
            # the cache is filled, and decode cost then grows with the text, not with max_len.
            s = mask.shape[-1]
            k, v = k_cache[..., :s, :], v_cache[..., :s, :]  # attended in the cache's dtype
        return self.attend(q, k, v, mask)


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up = nn.Linear(cfg.d_model, 2 * cfg.ffn_dim, bias=False)
        self.down = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x, cos, sin, kv=None, slots=None, mask=None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, kv, slots, mask)
        return x + self.mlp(self.mlp_norm(x))
