"""Heads 2..h run as one stacked module: the model's own head code, every op once for all heads.

At small batch much of a block's cost is per-op overhead (CPU dispatch, GPU kernel launches), so
h - 1 draft heads run one after the other cost about h - 1 blocks, which eats the speedup of
speculation on a model with few trunk layers. `stack_blocks` turns heads 2..h into one module of
the same class with stacked weights, built once per model and head count (and rebuilt only when
the heads' weights change). Head 1, which decides the output, always runs through
`model.head_output` itself, so the output is unaffected: the drafts may differ from the
unstacked heads' in the last bits, which only changes what is proposed (and q is what was really
sampled from, so sampling stays exact).

NOTE: at batch 1 on a CPU, stacked heads 2..h with their unembedding cost less than one block
run per head, and what is left is reading the heads' and the unembedding's weights: bandwidth,
not op count. `mtp bench decode --threads 1` shows the drafting share of a round (`draft_pct`).
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Sequence

import torch
from torch import nn

from mtp.model.layers import RMSNorm
from mtp.model.transformer import KVCache, MTPTransformer

__all__ = ["StackedHeads", "StackedLinear", "stack_blocks", "stacked_heads"]


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
    """J modules of one kind (e.g. heads of one type) as one module of the same class.

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


class StackedHeads:
    """Heads 2..heads of a model as one stacked module (see the module docstring)."""

    def __init__(self, model: MTPTransformer, heads: int) -> None:
        self.model, self.n = model, heads - 1
        self.first_layer = model.head_layers[1] if heads > 1 else None  # cache layer of head 2
        self.cached = self.first_layer is not None  # linear and medusa heads keep no keys
        self.stacked = stack_blocks(list(model.heads[1:heads])) if self.n else None

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
        x = self.model.head_input(h)  # the heads' input, once for all of them
        return self.model.head_norm(self.stacked(x.expand(self.n, *x.shape), *rope, kv, slots,
                                                 mask))


_BUILT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _weights_key(model: MTPTransformer) -> tuple:
    drafted = [*model.heads.parameters()] + (
        [model.unembed.weight, model.draft_ids] if model.cfg.draft_vocab else [])
    return tuple((p.data_ptr(), p._version, p.dtype, p.device) for p in drafted)


def stacked_heads(model: MTPTransformer, heads: int) -> StackedHeads:
    """The stacked heads 2..heads of `model`, built on first use and kept with the model."""
    key = _weights_key(model)
    built = _BUILT.setdefault(model, {})
    if heads not in built or built[heads][0] != key:
        built[heads] = (key, StackedHeads(model, heads))
    return built[heads][1]
