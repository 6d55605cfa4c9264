"""Frozen-trunk training (`--optim.train heads`): heads 2..K learn on a trunk that never changes.

With the trunk, head 1, the embedding, the final norm and the unembedding frozen, a training step
needs of them only what they output for its windows: the trunk output h, and with `--loss.targets
self` or `greedy` head 1's greedy tokens. `FrozenTrunk` computes both in one forward without a
graph and keeps them per window (keyed by its tokens), so later epochs read them back instead of
running the trunk again; the `frozen_trunk` path of `mtp.train.loss` then trains heads 2..K from
h. What this saves per token: docs/design-notes.md, "Frozen-trunk training".
"""

from __future__ import annotations

import torch

from mtp.model.transformer import MTPTransformer, Rope
from mtp.train.targets import greedy_predictions, mtp_inputs_targets, targets_from_predictions

__all__ = ["FrozenTrunk"]


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
        # Head 1's greedy token after each of the first T + K - 1 tokens, as `self_targets`
        # computes them. The trunk is causal, so its first T outputs are the heads' inputs.
        h, rope = model.trunk(window[:, :-1])  # (B, T + K - 1, d)
        preds = greedy_predictions(model, h, rope)  # (B, T + K - 1)
        return h[:, :T], targets_from_predictions(window, preds, K,
                                                  on_greedy_path=self.targets == "greedy")

    def __call__(self, window: torch.Tensor) -> tuple[torch.Tensor, Rope, torch.Tensor]:
        """h (B, T, d), the rotary tables of its positions and targets (K, B, T) of the windows
        (B, T + K): what the `frozen_trunk` path of `mtp.train.loss.heads_loss` reads."""
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
        positions = torch.arange(h.shape[1], device=h.device).expand(h.shape[0], -1)
        return h, self.model.rotary(positions), targets
