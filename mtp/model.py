"""The multi-token-prediction transformer, in pure PyTorch.

A shared trunk of `n_trunk_layers` blocks feeds K output heads; head i (1-based) predicts the token
i positions ahead (Gloeckle et al. 2024). All heads share one final RMSNorm and one unembedding
W (V x d). With K = 1 this is exactly a standard next-token transformer of `n_layers + 1` blocks.

Dimension names: B batch, T new tokens, S cached slots, d width, V vocabulary, K heads,
H attention heads, Hkv key/value heads, hd head width.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from mtp.config import MODEL_REGISTRY, ModelConfig

T_out = TypeVar("T_out")

__all__ = [
    "KVCache", "MODEL_REGISTRY", "MTPTransformer", "ModelConfig", "build_model", "stack_blocks",
]


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
        torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim)
    angles = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float64), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of channels of x (B, H, T, hd) by position; cos, sin are (B, 1, T, hd / 2)."""
    x1, x2 = x.to(cos.dtype).unflatten(-1, (-1, 2)).unbind(-1)  # (B, H, T, hd/2) each
    rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class KVCache:
    """Pre-allocated keys and values for every attention layer, trunk and heads alike.

    Each batch row has its own number of committed slots (`lengths`), so rows of a batch may
    accept different numbers of speculated tokens. Callers write new tokens at explicit `slots`
    and pass the attention mask; `compact` and `truncate` keep only accepted entries.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        batch_size: int,
        max_len: int | None = None,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        n_layers = cfg.n_trunk_layers + (cfg.n_future if cfg.head_type == "block" else 0)
        self.max_len = max_len or cfg.max_seq_len
        shape = (n_layers, batch_size, cfg.kv_heads, self.max_len, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)  # (L, B, Hkv, S, hd)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)  # (B,)

    def truncate(self, lengths: torch.Tensor) -> None:
        """Roll each row back to `lengths` committed slots (entries past it are ignored)."""
        self.lengths = lengths.to(self.lengths)

    def compact(self, src_slots: torch.Tensor, dst_start: torch.Tensor) -> None:
        """Move entries at `src_slots` (B, n) to contiguous slots from `dst_start` (B,) on.

        Used after tree verification, where the accepted path is scattered over the tree slots.
        """
        n = src_slots.shape[1]
        dst = dst_start[:, None] + torch.arange(n, device=src_slots.device)  # (B, n)
        for buf in (self.k, self.v):
            idx = src_slots[None, :, None, :, None].expand(buf.shape[0], -1, buf.shape[2], -1,
                                                            buf.shape[4])
            moved = buf.gather(3, idx)  # gather first: sources and destinations may overlap
            buf.scatter_(3, dst[None, :, None, :, None].expand_as(idx), moved)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.hd = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, (cfg.n_heads + 2 * cfg.kv_heads) * cfg.head_dim,
                             bias=cfg.attn_bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor] | None = None,
        slots: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # Leading dimensions "..." are (B,) for one block and (J, B) for J stacked blocks
        # (`stack_blocks`), which run the same code with one weight per block.
        q, k, v = rearrange(self.qkv(x), "... t (h hd) -> ... h t hd", hd=self.hd).split(
            [self.n_heads, self.n_kv, self.n_kv], dim=-3
        )  # (..., H, T, hd), (..., Hkv, T, hd) x 2
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv is not None:
            k_cache, v_cache = kv  # (..., Hkv, S, hd)
            idx = slots[:, None, :, None].expand(k.shape)
            k_cache.scatter_(-2, idx, k.to(k_cache.dtype))
            v_cache.scatter_(-2, idx, v.to(v_cache.dtype))
            # Attend over the first S slots only, S = the mask's width: the caller knows how far
            # the cache is filled, and decode cost then grows with the text, not with max_len.
            s = mask.shape[-1]
            k, v = k_cache[..., :s, :].to(q.dtype), v_cache[..., :s, :].to(q.dtype)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=self.n_kv != self.n_heads
        )  # (..., H, T, hd)
        return self.proj(rearrange(out, "... h t hd -> ... t (h hd)"))


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


class LinearHead(nn.Module):
    """A d x d linear map of the trunk output (no residual, no norm of its own; the shared
    final norm follows): the cheapest head, one matrix per future offset."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x, cos, sin, kv=None, slots=None, mask=None) -> torch.Tensor:
        return self.proj(x)


class StackedLinear(nn.Module):
    """J linear maps applied at once: (J, ..., in) -> (J, ..., out) in one matmul."""

    def __init__(self, weights: Sequence[torch.Tensor],
                 biases: Sequence[torch.Tensor] | None = None) -> None:
        super().__init__()
        self.register_buffer("weight_t", torch.stack([w.detach().T for w in weights]),
                             persistent=False)  # (J, in, out)
        bias = None if biases is None else torch.stack([b.detach() for b in biases])[:, None]
        self.register_buffer("bias", bias, persistent=False)  # (J, 1, out) or None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        j, d_in, d_out = self.weight_t.shape
        flat = x.reshape(j, -1, d_in)
        out = torch.bmm(flat, self.weight_t) if self.bias is None else \
            torch.baddbmm(self.bias, flat, self.weight_t)
        return out.view(*x.shape[:-1], d_out)


def stack_blocks(blocks: Sequence[nn.Module]) -> nn.Module:
    """J modules of one kind (heads: `Block` or `LinearHead`) as one module of the same class.

    The result runs the class's own forward on inputs with a leading axis of J, (J, B, T, d) ->
    (J, B, T, d), and with a cache of J layers (J, B, Hkv, S, hd): each linear map becomes a
    `StackedLinear` and each norm gain a (J, 1, 1, d) tensor, so every op runs once for all J
    blocks. A snapshot for inference: later changes to the blocks' weights are not seen.
    """
    kinds = {type(b) for b in blocks}
    if len(kinds) != 1:
        names = sorted(k.__name__ for k in kinds)
        raise ValueError(f"stack_blocks needs blocks of one class (got {names})")
    stacked = copy.deepcopy(blocks[0]).requires_grad_(False)
    for name, module in blocks[0].named_modules():
        parts = [b.get_submodule(name) for b in blocks]
        if isinstance(module, nn.Linear):
            parent, _, leaf = name.rpartition(".")
            biases = None if module.bias is None else [p.bias for p in parts]
            setattr(stacked.get_submodule(parent), leaf,
                    StackedLinear([p.weight for p in parts], biases))
        elif isinstance(module, RMSNorm):
            norm = stacked.get_submodule(name)
            del norm.weight
            norm.weight = torch.stack([p.weight.detach() for p in parts])[:, None, None, :]
    return stacked


class MTPTransformer(nn.Module):
    """Shared trunk, K heads, one shared final norm and unembedding.

    The three entry points are `trunk` (tokens to trunk output h), `head_hidden` (h to the
    normalised input of the unembedding for one head) and `forward` (logits of every head). The
    memory-efficient loss uses the first two with the unembedding weight `self.unembed.weight`.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_trunk_layers))
        head_cls = Block if cfg.head_type == "block" else LinearHead
        self.heads = nn.ModuleList(head_cls(cfg) for _ in range(cfg.n_future))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.unembed = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)  # (max_seq_len, hd/2)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()
        if cfg.tie_embeddings:
            self.unembed.weight = self.embed.weight

    def reset_parameters(self) -> None:
        """Normal(0, std) weights, unit norm gains, zero biases; residual output projections
        scaled by 1/sqrt(2 * blocks)."""
        n_blocks = self.cfg.n_trunk_layers + self.cfg.n_future
        for name, p in self.named_parameters():
            if name.endswith(".bias"):
                nn.init.zeros_(p)
            elif p.dim() == 1:
                nn.init.ones_(p)
            elif name.endswith(("attn.proj.weight", "mlp.down.weight")):
                nn.init.normal_(p, std=self.cfg.init_std / math.sqrt(2 * n_blocks))
            else:
                nn.init.normal_(p, std=self.cfg.init_std)

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cosine and sine tables (B, 1, T, hd / 2) for RoPE positions (B, T)."""
        if positions.max() >= self.cfg.max_seq_len:
            raise ValueError(
                f"position {int(positions.max())} is past --model.max_seq_len "
                f"({self.cfg.max_seq_len})"
            )
        dtype = torch.promote_types(self.embed.weight.dtype, torch.float32)
        return (self.rope_cos[positions][:, None].to(dtype),
                self.rope_sin[positions][:, None].to(dtype))

    def _layer_kv(self, cache: KVCache | None, layer: int):
        return None if cache is None else (cache.k[layer], cache.v[layer])

    def trunk(
        self,
        idx: torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
        slots: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Embed and run the trunk.

        Args:
            idx: token ids (B, T).
            positions: RoPE positions (B, T); default 0..T-1.
            cache: KV cache to write into and attend over (then `slots` and `mask` are needed).
            slots: cache slot of each new token (B, T).
            mask: boolean attention mask (B, 1, T, S), True where attention is allowed, over the
                first S cache slots. None (only without a cache) means causal attention over the
                T new tokens.

        Returns:
            The trunk output h (B, T, d) and the rotary tables to pass on to `head_hidden`.
        """
        if cache is not None and (slots is None or mask is None):
            raise ValueError("decoding with a KV cache needs both `slots` and `mask`")
        if positions is None:
            positions = torch.arange(idx.shape[1], device=idx.device).expand(idx.shape[0], -1)
        rope = self.rotary(positions)
        x = self.embed(idx)  # (B, T, d)
        for i, block in enumerate(self.blocks):
            x = block(x, *rope, self._layer_kv(cache, i), slots, mask)
        return x, rope

    def head_hidden(
        self,
        i: int,
        h: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        *,
        cache: KVCache | None = None,
        slots: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Normalised input of the unembedding for head i (0-based: predicts token t + i + 1).

        Returns:
            (B, T, d); the logits are `unembed(head_hidden(...))`.
        """
        # linear heads have no attention, hence nothing in the cache
        kv = self._layer_kv(cache, self.cfg.n_trunk_layers + i) \
            if self.cfg.head_type == "block" else None
        return self.norm(self.heads[i](h, *rope, kv, slots, mask))

    def forward(
        self,
        idx: torch.Tensor,
        *,
        heads: int | None = None,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
        slots: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        heads_fn: Callable[[torch.Tensor, tuple[torch.Tensor, torch.Tensor]], T_out] | None = None,
    ) -> torch.Tensor | T_out:
        """Logits of the first `heads` heads (default all K): (K, B, T, V).

        With `heads_fn`, return `heads_fn(h, rope)` of the trunk output h (B, T, d) instead: the
        memory-efficient loss runs the heads itself, and doing so inside this call lets wrappers
        that hook the forward (FSDP, DDP) see one forward of the whole model.
        """
        heads = self.cfg.n_future if heads is None else heads
        if not 1 <= heads <= self.cfg.n_future:
            raise ValueError(f"heads must be in [1, {self.cfg.n_future}] (got {heads})")
        h, rope = self.trunk(idx, positions=positions, cache=cache, slots=slots, mask=mask)
        if heads_fn is not None:
            return heads_fn(h, rope)
        return torch.stack([
            self.unembed(self.head_hidden(i, h, rope, cache=cache, slots=slots, mask=mask))
            for i in range(heads)
        ])  # (K, B, T, V)

    def num_params(self, *, embedding: bool = True) -> int:
        """Parameter count (shared tensors counted once); optionally without the input embedding."""
        n = sum(p.numel() for p in self.parameters())
        if not embedding and not self.cfg.tie_embeddings:
            n -= self.embed.weight.numel()
        return n

    def flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs of one training token (forward + backward) at context length `seq_len`.

        Each weight matrix costs 6 FLOPs per entry each time it runs (2 forward, 4 backward):
        the trunk's once, every head's own once, and the shared unembedding once per head, i.e.
        K times. Each attention layer adds 12 * d * seq_len for its score and value matmuls
        (PaLM appendix B). The embedding lookup, RMSNorm gains, RoPE, softmax and the loss
        count as zero. The basis of MFU and of `mtp bench train`'s FLOP-model ratio.
        """
        # NOTE: the attention term counts the full T x T score matrix although the mask is
        # causal (PaLM's convention; torch's FlopCounterMode also counts fused SDPA as full
        # T x T, with a 2.5x backward that includes the recomputed scores). A causal flash kernel
        # executes about half of it, so MFU on this basis is the comparable PaLM-style one,
        # not the hardware utilisation of attention. Counting the unembedding once instead of
        # K times read 14% low at 1B, K = 4, T = 4096 (7.22 against 8.40 GFLOP per token), 33%
        # low for the `cpu` model at K = 4, T = 128.
        # tests/test_flops.py checks this against FlopCounterMode over a real step (SDPA's math
        # backend, whose bmm's it counts): exactly equal for K in {1, 4} and both head types.
        matrices = sum(p.numel() for part in (self.blocks, self.heads)
                       for p in part.parameters() if p.dim() > 1)
        unembed = self.cfg.n_future * self.unembed.weight.numel()
        n_attn = sum(isinstance(m, Attention) for m in self.modules())
        return 6 * (matrices + unembed) + 12 * n_attn * self.cfg.d_model * seq_len


def build_model(cfg: ModelConfig) -> MTPTransformer:
    """The model of a config (the factory every other component calls)."""
    return MTPTransformer(cfg)
