"""The output heads' targets: `heads[i]` at position t is trained on token t + i + 1 (head 1,
`heads[0]`, on the next token).

`mtp_inputs_targets` cuts the inputs and the K target rows out of windows of T + K tokens: the
data's own tokens. `--loss.targets self` and `greedy` train on the model's own greedy tokens
instead (self-distillation, `self_targets`), from head 1's argmax at every position
(`greedy_predictions`). Joint training with `--loss.soft_targets` scores the heads against
the distributions of the model as training started (`FrozenTeacher`, Medusa-2's
self-distillation).
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass

import torch

from mtp.model.transformer import MTPTransformer

#: A target that no head is scored on (PyTorch's `ignore_index` default).
IGNORE_INDEX = -100

__all__ = ["IGNORE_INDEX", "FrozenTeacher", "Teacher", "greedy_predictions", "mtp_inputs_targets",
           "self_targets", "targets_from_predictions"]


def mtp_inputs_targets(window: torch.Tensor, n_future: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split windows (B, T + K) into inputs (B, T) and targets (K, B, T).

    targets[i, b, t] = window[b, t + i + 1]: `heads[i]` sees the token i + 1 positions ahead.
    """
    T = window.shape[1] - n_future
    if T < 1:
        raise ValueError(f"windows of {window.shape[1]} tokens are too short for K = {n_future}")
    targets = window.unfold(1, T, 1)[:, 1:n_future + 1]  # (B, K, T)
    return window[:, :T], targets.transpose(0, 1)


@torch.no_grad()
def greedy_predictions(model: MTPTransformer, h: torch.Tensor,
                       rope: tuple[torch.Tensor, torch.Tensor], chunk: int = 4096) -> torch.Tensor:
    """Head 1's argmax (B, T) at every position of the trunk output h (B, T, d), over at most
    `chunk` positions at a time, so no logits of the whole batch are held."""
    z = model.head_norm(model.head_output(0, h, rope)).flatten(0, 1)  # (B * T, d)
    return torch.cat([model.unembed(part).argmax(-1) for part in z.split(chunk)]) \
        .view(h.shape[0], -1)


def targets_from_predictions(window: torch.Tensor, preds: torch.Tensor, n_future: int, *,
                             on_greedy_path: bool = False) -> torch.Tensor:
    """Self-distillation targets (K, B, T) of windows (B, T + K) from the model's greedy
    predictions (B, T + K - 1), preds[:, s] being head 1's argmax after tokens 0..s.

    `heads[i]` at position t gets preds[:, t + i], the model's prediction of token t + i + 1
    given the data before it. `on_greedy_path` keeps it only where the data's tokens t + 1 ..
    t + i are the model's own greedy ones (elsewhere `IGNORE_INDEX`): there it is token i + 1 of
    the greedy continuation from t, the token `heads[i]` must draft to be accepted.
    """
    T = window.shape[1] - n_future
    targets = torch.stack([preds[:, i:i + T] for i in range(n_future)])  # (K, B, T)
    if on_greedy_path:
        agree = window[:, 1:] == preds  # (B, T + K - 1): token s + 1 is the greedy one
        on_path = torch.ones_like(agree[:, :T])
        for i in range(1, n_future):
            on_path = on_path & agree[:, i - 1:i - 1 + T]
            targets[i] = targets[i].masked_fill(~on_path, IGNORE_INDEX)
    return targets


@torch.no_grad()
def self_targets(model: MTPTransformer, window: torch.Tensor, chunk: int = 4096, *,
                 on_greedy_path: bool = False) -> torch.Tensor:
    """The targets of `--loss.targets self` (or `greedy`, with `on_greedy_path`): (K, B, T) from the
    model's own greedy predictions (`mtp.train.targets.targets_from_predictions`), head 1's argmax
    after each of the window's first T + K - 1 tokens.

    Head 1's argmax (`mtp.train.targets.greedy_predictions`) runs over at most `chunk` positions at
    a time; it runs through the model's forward, so FSDP gathers what it needs.
    """
    was_training = model.training
    model.eval()
    try:
        preds = model(window[:, :-1], heads_fn=functools.partial(greedy_predictions, model,
                                                                 chunk=chunk))
    finally:
        model.train(was_training)
    return targets_from_predictions(window, preds, model.cfg.n_future,
                                    on_greedy_path=on_greedy_path)


@dataclass
class Teacher:
    """The frozen model's view of one batch: its normalised final hidden states z (B, T, d) and
    its unembedding W (V, d). Head i's soft target at position t is softmax(z[:, t + i] @ W.T),
    over head i's vocabulary (`mtp.train.loss`, `soft_sequential_path`)."""

    z: torch.Tensor
    W: torch.Tensor


class FrozenTeacher:
    """A frozen copy of the model as training starts (the pretrained model of `--model.init_from`),
    whose distributions joint training learns under `--loss.soft_targets`: head 1 keeps the
    model's own next-token distribution (Medusa-2's self-distillation, a KL to the frozen
    logits), and heads 2..K learn it i tokens ahead.

    A plain object, not a submodule, so that checkpoints hold the trained model alone; it follows
    the inputs' device on its first call.
    """

    def __init__(self, model: MTPTransformer) -> None:
        self.model = copy.deepcopy(model).requires_grad_(False).eval()
        del self.model.heads[1:]  # only head 1's distribution is read

    @torch.no_grad()
    def __call__(self, inputs: torch.Tensor) -> Teacher:
        m = self.model
        if m.unembed.weight.device != inputs.device:
            m.to(inputs.device)
        z = m(inputs, heads_fn=lambda h, rope: m.head_norm(m.head_output(0, h, rope)))
        return Teacher(z, m.unembed.weight)
