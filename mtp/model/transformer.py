"""The multi-token-prediction transformer, in pure PyTorch.

A shared trunk of `n_trunk_layers` blocks feeds K output heads (`mtp.model.heads`); `heads[i]`
predicts the token i + 1 positions ahead (Gloeckle et al. 2024). All heads share one final RMSNorm
and one unembedding W (V x d); the norm follows each head, except for `medusa1` heads, which read
the normalised trunk output (Medusa-1's layout). With K = 1 and block or deepseek heads this is
exactly a standard next-token transformer of `n_layers + 1` blocks, with medusa1 heads one of
`n_layers` blocks. The layers are in `mtp.model.layers`.

Dimension names: B batch, T new tokens, S cached slots, d width, V vocabulary, K output heads,
H attention heads, Hkv key/value attention heads, hd attention-head width.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch
from torch import nn

from mtp.config import ModelConfig, feature_layers_problems
from mtp.model.heads import CASCADED, PRE_NORM, UNROLLED, build_heads, head_cache_layers, shift_rope
from mtp.model.layers import Attention, Block, RMSNorm, rope_tables
from mtp.util.errors import ConfigError

T_out = TypeVar("T_out")
#: The rotary tables (cos, sin), each (B, 1, T, hd / 2), that `trunk` returns beside h.
Rope = tuple[torch.Tensor, torch.Tensor]

__all__ = [
    "KVCache", "MTPTransformer", "Rope", "build_model",
]


class KVCache:
    """Pre-allocated keys and values for every attention layer, trunk and heads alike.

    Each batch row has its own number of committed slots (`lengths`), so rows of a batch may
    accept different numbers of speculated tokens. Callers write new tokens at explicit `slots`
    and pass the attention mask; `compact` and `truncate` keep only accepted entries. Rows leave
    (`keep`) and others take their places (`join`) within the `batch_size` rows allocated.
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
        n_layers = cfg.n_trunk_layers + len({x for x in head_cache_layers(cfg) if x is not None})
        self.max_len = max_len or cfg.max_seq_len
        shape = (n_layers, batch_size, cfg.attn_kv_heads, self.max_len, cfg.attn_head_dim)
        # The buffers allocated; k and v are views of their first rows, those in use.
        self._k = torch.zeros(shape, device=device, dtype=dtype)  # (L, B, Hkv, S, hd)
        self._v = torch.zeros(shape, device=device, dtype=dtype)
        self.k, self.v = self._k, self._v
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)  # (B,)

    def truncate(self, lengths: torch.Tensor) -> None:
        """Roll each row back to `lengths` committed slots (entries past it are ignored)."""
        self.lengths = lengths.to(self.lengths)

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only batch rows `rows` (distinct indices, in any order), which become rows
        0..n-1.

        In place, and only what a later step reads: the rows that move (with the decode loop's
        `fill_order`, one per row that left), over the slots in use, so that a batched decode
        whose rows end one by one copies no whole buffer. The buffers become views of their
        first n rows."""
        n = len(rows)
        lengths = self.lengths[rows]
        used = int(lengths.max()) if n else 0
        moves = (rows != torch.arange(n, device=rows.device)).nonzero().flatten()
        if len(moves) and used:
            src, dst = rows[moves], moves
            for buf in (self.k, self.v):
                buf[:, dst, :, :used] = buf[:, src, :, :used]
        self.k, self.v, self.lengths = self._k[:, :n], self._v[:, :n], lengths

    def join(self, other: KVCache) -> None:
        """Append `other`'s rows (a cache of the same model, e.g. new prompts' prefill) after
        these, as rows n.., in the rows allocated that `keep` left free; their slots in use are
        copied."""
        n, m = self.k.shape[1], other.k.shape[1]
        if n + m > self._k.shape[1] or other.max_len > self.max_len:
            raise ValueError(f"{m} rows of {other.max_len} slots do not fit beside {n} rows in "
                             f"a cache of {self._k.shape[1]} rows of {self.max_len} slots")
        used = int(other.lengths.max()) if m else 0
        for buf, new in ((self._k, other.k), (self._v, other.v)):
            buf[:, n : n + m, :, :used] = new[:, :, :, :used]
        self.k, self.v = self._k[:, : n + m], self._v[:, : n + m]
        self.lengths = torch.cat([self.lengths, other.lengths.to(self.lengths)])

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


class MTPTransformer(nn.Module):
    """Shared trunk, K output heads, one shared final norm and unembedding.

    Entry points, by what they return:

    - `model(idx, heads=n)`: logits (n, B, T, V) of the first n heads, optionally over a cache.
    - `model(idx, heads_fn=fn)`: `fn(h, rope)` of the trunk output h, inside the model's forward,
      so that a wrapper hooking the forward (FSDP's root unit) sees the whole computation: how
      the heads' loss runs (`mtp.train.loss.mtp_loss`).
    - `trunk`: the trunk output h (B, T, d) and the rotary tables.
    - `head_output`: one head's output (B, T, d); `head_norm` of it is its normalised state.
    - `head_states`: every head's normalised state in turn, cascaded heads fed on one another.

    The logits of a normalised state z are `unembed(z)` for head 1 and `draft_logits(z)` for
    heads 2..K; `head_unembed` and `head_targets` give a head's unembedding rows and classes.
    Who calls which: docs/design-notes.md, "The model's entry points".
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_trunk_layers))
        self.heads = build_heads(cfg)
        self.cascaded = cfg.head_type in CASCADED  # head i reads head i - 1's output
        self.unrolled = cfg.head_type in UNROLLED  # heads 2..K: one layer, unrolled
        self.pre_norm = cfg.head_type in PRE_NORM  # the shared norm before the heads, not after
        self.head_layers = head_cache_layers(cfg)
        if problems := feature_layers_problems(cfg, depth_known=True):
            raise ConfigError(problems[0])
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.unembed = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)  # (max_seq_len, hd/2)
        self.register_buffer("rope_sin", sin, persistent=False)
        if cfg.draft_vocab:  # the token ids heads 2..K predict over, set from the data
            self.register_buffer("draft_ids", torch.arange(cfg.draft_vocab))  # (Vd,)
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
        for head in self.heads:
            if hasattr(head, "reset_parameters"):  # a head type's own initialisation (Medusa)
                head.reset_parameters()

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
            The trunk output h (B, T, d) and the rotary tables to pass on to `head_output` or
            `head_states`. With `--model.feature_layers` h is (B, T, (n + 1) d): the listed
            blocks' outputs, then the last's, which alone head 1 reads (`MainOutput`).
        """
        if cache is not None and (slots is None or mask is None):
            raise ValueError("decoding with a KV cache needs both `slots` and `mask`")
        if positions is None:
            positions = torch.arange(idx.shape[1], device=idx.device).expand(idx.shape[0], -1)
        rope = self.rotary(positions)
        x = self.embed(idx)  # (B, T, d)
        features = []
        for i, block in enumerate(self.blocks):
            x = block(x, *rope, self._layer_kv(cache, i), slots, mask)
            if i + 1 in self.cfg.feature_layers:
                features.append(x)
        return (torch.cat([*features, x], dim=-1) if features else x), rope

    def head_output(
        self,
        i: int,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        *,
        tokens: torch.Tensor | None = None,
        cache: KVCache | None = None,
        slots: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        run: Callable[..., torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Head i's output (B, T, d) (0-based i: predicts token t + i + 1), which `head_norm`
        turns into its normalised hidden state.

        Args:
            x: the trunk output h (B, T, d), which the head reads as `head_input(x)`; for cascaded
                heads (`deepseek`), head i - 1's output (h for head 0).
            tokens: cascaded heads from i = 1 on: the ids (B, T) of the token at offset i, the one
                head i - 1 predicts (the data's when training, a draft when drafting).
            run: the head's callable (default the head module; the sequential loss passes the
                forward of an FSDP-gathered head).
        """
        run = run or self.heads[i]
        layer = self.head_layers[i]
        kv = None if cache is None or layer is None else (cache.k[layer], cache.v[layer])
        if self.cascaded and i > 0:
            if tokens is None:
                raise ValueError(f"head {i + 1} of a {self.cfg.head_type} model reads the token "
                                 f"at offset {i}: pass `tokens`")
            # an ignored target (-100) is read as token 0; its own prediction is never scored
            return run(x, self.embed(tokens.clamp(min=0)), *rope, kv, slots, mask)
        return run(self.head_input(x), *rope, kv, slots, mask)

    def head_input(self, h: torch.Tensor) -> torch.Tensor:
        """What parallel heads read of the trunk output h (..., d): h itself, or for the heads
        that read the normalised trunk output (`medusa1`) the shared norm of it."""
        return self.norm(h) if self.pre_norm else h

    def head_norm(self, out: torch.Tensor) -> torch.Tensor:
        """A head's normalised hidden state (..., d), the unembedding's input, from its output:
        the shared norm of it, or for heads that read the normalised trunk output (`medusa1`)
        the output itself."""
        return out if self.pre_norm else self.norm(out)

    def head_unembed(self, i: int) -> torch.Tensor:
        """The unembedding rows head i (0-based) predicts over: W (V, d), or for heads 2..K with
        a draft vocabulary its rows W[draft_ids] (Vd, d)."""
        W = self.unembed.weight
        return W if i == 0 or not self.cfg.draft_vocab else W[self.draft_ids]

    def head_targets(self, i: int, targets: torch.Tensor) -> torch.Tensor:
        """Token ids as head i's classes: themselves, or for heads 2..K with a draft vocabulary
        their index in `draft_ids`, -100 (ignored) for a token outside it."""
        if i == 0 or not self.cfg.draft_vocab:
            return targets
        index = targets.new_full((self.cfg.vocab_size,), -100)
        index[self.draft_ids] = torch.arange(len(self.draft_ids), device=targets.device)
        return torch.where(targets >= 0, index[targets.clamp(min=0)], targets)

    def draft_logits(self, z: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (..., V) of heads 2..K from their normalised hidden states z (..., d): the
        draft vocabulary's, -inf elsewhere (so argmax, top-k and sampling draft from it alone),
        or the whole vocabulary's without one. `rows` is `head_unembed(1)` where the caller
        keeps it."""
        if not self.cfg.draft_vocab:
            return self.unembed(z)
        rows = self.head_unembed(1) if rows is None else rows
        scores = z @ rows.T  # in the product's dtype (bf16 under autocast), as `unembed`'s
        out = scores.new_full((*z.shape[:-1], self.cfg.vocab_size), float("-inf"))
        return out.index_copy_(-1, self.draft_ids, scores)

    def head_states(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                    tokens: torch.Tensor | None = None, heads: int | None = None,
                    **kw) -> Iterator[torch.Tensor]:
        """Normalised hidden states (B, T, d) of heads start..heads-1 in order, from the trunk
        output h (B, T, d): `head_outputs` through the shared norm (`head_norm`)."""
        return map(self.head_norm, self.head_outputs(h, rope, tokens, heads, **kw))

    def head_outputs(
        self,
        h: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        tokens: torch.Tensor | None = None,
        heads: int | None = None,
        *,
        cache: KVCache | None = None,
        slots: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        start: int = 0,
    ) -> Iterator[torch.Tensor]:
        """Outputs (B, T, d) of heads start..heads-1 in order, before the shared norm, from the
        trunk output h (B, T, d); cascaded heads read one another (those before `start` run
        unseen) and head i reads tokens[i - 1], e.g. the targets (K, B, T) of
        `mtp.train.targets.mtp_inputs_targets`. `cache`, `slots` and `mask` are `head_output`'s;
        `eagle` heads unroll without a cache (`EagleLayer.unrolled`), step i at positions i - 1
        further on, each output the feature the next step reads; their one layer runs as many
        steps as `heads` asks, also past K."""
        x, past = h, []
        for i in range(self.cfg.n_future if heads is None else heads):
            if i < start and not self.cascaded:
                continue
            if self.unrolled and i > 0:
                if cache is not None:
                    raise ValueError("eagle heads draft through mtp.decoding.eagle")
                rope_i = shift_rope(*rope, self.rope_cos, self.rope_sin, i - 1)
                # step 1 reads the trunk output whole (its feature layers too), not head 1's part
                layer = self.heads[min(i, len(self.heads) - 1)]  # the one layer, every step
                out, kv = layer.unrolled(h if i == 1 else x,
                                         self.embed(tokens[i - 1].clamp(min=0)), *rope_i, past)
                past.append(kv)
            else:
                out = self.head_output(i, x if self.cascaded else h, rope,
                                       tokens=None if tokens is None or i == 0 else tokens[i - 1],
                                       cache=cache, slots=slots, mask=mask)
            x = out
            if i >= start:
                yield out

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
        """Logits (heads, B, T, V) of the first `heads` heads (default all K; for `eagle`, whose
        one layer runs once per step, any number: steps past K run it further); with a draft
        vocabulary, heads 2..K's are -inf outside it (`draft_logits`). `positions`, `cache`,
        `slots` and `mask` are `trunk`'s, and reach the heads' cache layers too.

        Cascaded heads (`deepseek`) read the input itself: head i at position t reads token
        t + i of idx, teacher-forced; where that lies past idx (the last i positions) it reads
        idx's last token, so those logits of heads 2..K are placeholders. A cached forward of
        cascaded heads gives head 1 only (`mtp.decoding` drafts with the others).

        With `heads_fn`, return `heads_fn(h, rope)` of the trunk output h (B, T, d) instead of
        logits (`heads` is then unused): the losses and metrics of `mtp.train.loss` run the heads
        themselves, and doing so inside this call lets a wrapper that hooks the model's forward
        (FSDP's root unit) see one forward of the whole model.
        """
        heads = self.cfg.n_future if heads is None else heads
        if heads < 1 or heads > self.cfg.n_future and not self.unrolled:  # eagle: any depth
            raise ValueError(f"heads must be in [1, {self.cfg.n_future}] (got {heads})")
        h, rope = self.trunk(idx, positions=positions, cache=cache, slots=slots, mask=mask)
        if heads_fn is not None:
            return heads_fn(h, rope)
        tokens = None
        if self.cascaded and heads > 1:
            if cache is not None:
                raise ValueError("a cached forward of cascaded heads needs each head's own "
                                 "tokens: decode through mtp.decoding")
            # tokens[i - 1][:, t] = idx[:, t + i], clamped at the end
            t = torch.arange(idx.shape[1], device=idx.device)
            tokens = torch.stack([idx[:, (t + i).clamp(max=idx.shape[1] - 1)]
                                  for i in range(1, heads)])
        states = self.head_states(h, rope, tokens, heads, cache=cache, slots=slots, mask=mask)
        return torch.stack([self.unembed(z) if i == 0 else self.draft_logits(z)
                            for i, z in enumerate(states)])  # (heads, B, T, V)

    @property
    def trunk_width(self) -> int:
        """Channels of the trunk output: d, or (n + 1) d with n `--model.feature_layers`."""
        return self.cfg.d_model * (1 + len(self.cfg.feature_layers))

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
        # causal (PaLM's convention, and torch's FlopCounterMode's), so MFU on this basis is the
        # comparable PaLM-style one, not the hardware utilisation of attention; the unembedding
        # counts K times, once per head. Why, with the figures: docs/design-notes.md, "The FLOP
        # model"; a test checks it against FlopCounterMode over a real step.
        # a head's matrices count each time it runs (eagle's one layer once per step)
        matrices = sum(p.numel() for part in (self.blocks, *self.heads)
                       for p in part.parameters() if p.dim() > 1)
        if self.unrolled and self.cfg.feature_layers:  # the fusing map runs in step 1 alone
            matrices -= (self.cfg.n_future - 2) * self.heads[1].fuse.weight.numel()
        V, d = self.unembed.weight.shape
        unembed = d * (V + (self.cfg.n_future - 1) * (self.cfg.draft_vocab or V))
        n_attn = sum(isinstance(m, Attention) for part in (self.blocks, *self.heads)
                     for m in part.modules())
        if self.unrolled:  # step i >= 2 also scores the i - 1 steps before it, T keys each
            n_attn += (self.cfg.n_future - 1) * (self.cfg.n_future - 2) // 2
        return 6 * (matrices + unembed) + 12 * n_attn * self.cfg.d_model * seq_len


def build_model(cfg: ModelConfig) -> MTPTransformer:
    """The model of a config (the factory every other component calls)."""
    return MTPTransformer(cfg)
