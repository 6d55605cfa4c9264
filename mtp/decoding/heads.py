"""Heads 2..h run as one stacked block: the model's own head code, every op once for all heads.

At small batch much of a block's cost is per-op overhead (CPU dispatch, GPU kernel launches), so
h - 1 draft heads run one after the other cost about h - 1 blocks, which eats the speedup of
speculation on a model with few trunk layers. `mtp.model.stack_blocks` turns heads 2..h into one
module of the same class with stacked weights, built once per model and head count (and rebuilt
only when the heads' weights change). Head 1, which decides the output, always runs through
`model.head_hidden` itself, so the output is unaffected: the drafts may differ from the
unstacked heads' in the last bits, which only changes what is proposed (and q is what was really
sampled from, so sampling stays exact).

NOTE: on the 2-core CPU, one thread, the default model (d = 192, K = 4), two committed tokens:
heads 2..4 with their unembedding one by one 5.2-6.2 ms, stacked 3.0-3.7 ms (a greedy forward
of the same model: 5.2-6.7 ms). What is left is reading the heads' and the unembedding's
weights: bandwidth, not op count.
"""

from __future__ import annotations

import weakref

import torch

from mtp.model import KVCache, MTPTransformer, stack_blocks

__all__ = ["DraftHeads", "draft_heads"]


class DraftHeads:
    """Heads 2..heads of a model as one stacked module (see the module docstring)."""

    def __init__(self, model: MTPTransformer, heads: int) -> None:
        self.model, self.n = model, heads - 1
        self.first_layer = model.head_layers[1] if heads > 1 else None  # cache layer of head 2
        self.cached = self.first_layer is not None  # linear and medusa heads keep no keys
        self.stacked = stack_blocks(list(model.heads[1:heads])) if self.n else None
        # a draft vocabulary's unembedding rows, gathered once (`MTPTransformer.draft_logits`)
        self.rows = model.head_unembed(1).detach() if self.n and model.cfg.draft_vocab else None

    def __call__(
        self,
        h: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: KVCache,
        slots: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """Normalised hidden states of heads 2..h (h-1, B, T, d) for trunk output h (B, T, d);
        their keys and values land at `slots` of the heads' cache layers."""
        kv = None
        if self.cached:
            layers = slice(self.first_layer, self.first_layer + self.n)
            kv = (cache.k[layers], cache.v[layers])
        x = self.stacked(h.expand(self.n, *h.shape), *rope, kv, slots, mask)
        return self.model.norm(x)

    def logits(self, z: torch.Tensor) -> torch.Tensor:
        """Draft logits (..., V) of normalised head states z (..., d)."""
        return self.model.draft_logits(z, self.rows)


_BUILT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _weights_key(model: MTPTransformer) -> tuple:
    drafted = [*model.heads.parameters()] + (
        [model.unembed.weight, model.draft_ids] if model.cfg.draft_vocab else [])
    return tuple((p.data_ptr(), p._version, p.dtype, p.device) for p in drafted)


def draft_heads(model: MTPTransformer, heads: int) -> DraftHeads:
    """The stacked heads 2..heads of `model`, built on first use and kept with the model."""
    key = _weights_key(model)
    built = _BUILT.setdefault(model, {})
    if heads not in built or built[heads][0] != key:
        built[heads] = (key, DraftHeads(model, heads))
    return built[heads][1]
