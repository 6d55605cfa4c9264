"""Heads-only training on a frozen trunk (`--optim.train heads`, Medusa-1).

With the trunk, head 1, the embedding, the final norm and the unembedding frozen, a training step
needs of them only what they output for its windows: the trunk output h, and with `--loss.targets
self` or `greedy` head 1's greedy tokens. `FrozenTrunk` computes both in one forward without a
graph and keeps them per window (keyed by its tokens), so later epochs read them back instead of
running the trunk again. `heads_loss` then trains heads 2..K by plain autograd from h: no trunk
backward, no loss or gradient for the frozen head 1, and the fused linear cross-entropy over each
head's vocabulary (its draft vocabulary where `--model.draft_vocab` gives one), so no N x V
logits.

NOTE: FLOPs per training token on SmolLM2-135M at K = 4 (block heads, 4096-token draft
vocabulary), counting 2 per weight and forward matmul, 6 with the backward: the general step
(`MTPModule.compute_loss`) costs about 757M: the self-distillation targets' trunk, head 1 and
full-vocabulary forward (269M), the trunk again (205M), head 1's full-vocabulary loss and
gradients (177M), heads 2..4 (106M). Here the first epoch costs 269M + 106M and later ones 106M.
"""

from __future__ import annotations

import torch

from mtp.kernels import linear_cross_entropy
from mtp.loss import (
    IGNORE_INDEX,
    MTPLossOutput,
    greedy_predictions,
    mtp_inputs_targets,
    targets_from_predictions,
    top1_accuracy,
)
from mtp.model import MTPTransformer

__all__ = ["FrozenTrunk", "heads_loss"]


class FrozenTrunk:
    """The frozen trunk's output and the targets of each training window, computed once.

    A window's entry is its trunk output h (T, d) and its K target rows (K, T): `max_bytes` of
    them are kept (later windows are computed each time they come). The key is the window's
    tokens, so a window finds its entry whatever batch it comes in (each epoch shuffles them).
    Valid only while the trunk and head 1 do not change, which `--optim.train heads` ensures.
    """

    def __init__(self, model: MTPTransformer, *, targets: str, max_bytes: int) -> None:
        self.model, self.targets, self.max_bytes = model, targets, max_bytes
        self.entries: dict[bytes, tuple[torch.Tensor, torch.Tensor]] = {}
        self.bytes = 0
        self.hits = self.misses = 0

    @torch.no_grad()
    def _compute(self, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h (B, T, d) and targets (K, B, T) of windows (B, T + K), in one trunk forward."""
        model, K = self.model, self.model.cfg.n_future
        T = window.shape[1] - K
        if self.targets == "data":
            inputs, targets = mtp_inputs_targets(window, K)
            return model.trunk(inputs)[0], targets
        # Head 1's greedy token after each of the first T + K - 1 tokens, as
        # `mtp.module.self_targets` computes them. The trunk is causal, so its first T outputs
        # are the heads' inputs.
        h, rope = model.trunk(window[:, :-1])  # (B, T + K - 1, d)
        preds = greedy_predictions(model, h, rope)  # (B, T + K - 1)
        return h[:, :T], targets_from_predictions(window, preds, K,
                                                  chain=self.targets == "greedy")

    def __call__(self, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h (B, T, d) and targets (K, B, T) of the windows (B, T + K)."""
        keys = [row.numpy().tobytes() for row in window.cpu()]
        missing = [b for b, key in enumerate(keys) if key not in self.entries]
        self.hits += len(keys) - len(missing)
        self.misses += len(missing)
        if len(missing) == len(keys):
            h, targets = self._compute(window)
        else:
            got = [self.entries.get(key) for key in keys]
            if missing:
                h_new, t_new = self._compute(window[missing])
                for j, b in enumerate(missing):
                    got[b] = (h_new[j], t_new[:, j])
            h = torch.stack([g[0] for g in got])
            targets = torch.stack([g[1] for g in got], dim=1)
        for b in missing:
            size = h[b].nbytes + targets[:, b].nbytes
            if self.bytes + size <= self.max_bytes:
                self.entries[keys[b]] = (h[b].clone(), targets[:, b].clone())
                self.bytes += size
        return h, targets


def heads_loss(model: MTPTransformer, h: torch.Tensor, targets: torch.Tensor,
               head_weights: list[float] | None = None, *,
               with_accuracy: bool = False) -> MTPLossOutput:
    """The weighted loss of heads 2..K from a frozen trunk's output h (B, T, d), differentiable
    in the heads' parameters; `head_losses` starts at head 2 (`first` = 1)."""
    K, T = model.cfg.n_future, h.shape[1]
    positions = torch.arange(T, device=h.device).expand(h.shape[0], -1)
    rope = model.rotary(positions)
    weights = head_weights or [1.0] * K
    x = model.head_output(0, h, rope) if model.chained else h  # chained heads read head 1's
    losses, accs, total = [], [], h.new_zeros((), dtype=torch.float32)
    for i in range(1, K):
        out = model.head_output(i, x, rope, tokens=targets[i - 1])
        x = out if model.chained else h
        z, W = model.head_norm(out).flatten(0, 1), model.head_unembed(i)
        t = model.head_targets(i, targets[i]).flatten()
        loss = linear_cross_entropy(z, W, t, ignore_index=IGNORE_INDEX)
        total = total + weights[i] * loss
        losses.append(loss.detach())
        if with_accuracy:
            accs.append(top1_accuracy(z.detach(), W, t))
    return MTPLossOutput(total, torch.stack(losses), torch.stack(accs) if accs else None,
                         first=1)
