"""The sampling distribution every decoder draws from, and one draw from it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Sampling", "multinomial", "probs_from_logits", "sample_from_logits"]


def probs_from_logits(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> torch.Tensor:
    """The sampling distribution: softmax(logits / temperature), cut to top-k, then to top-p.

    This is the target distribution p of plain sampling, and the one speculative sampling is
    exact with respect to. Ties at the k-th logit are all kept, so the result is deterministic.

    Args:
        logits: (..., V).
        temperature: > 0.
        top_k: keep the k most likely tokens (None: all).
        top_p: keep the smallest set of most likely tokens whose mass reaches top_p (None: all).

    Returns:
        fp32 probabilities (..., V) that sum to 1.
    """
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    p = logits.softmax(-1)
    if top_p is not None and top_p < 1.0:
        sorted_p, order = p.sort(dim=-1, descending=True)
        # Drop a token when the mass before it already reaches top_p; the first always stays.
        drop = sorted_p.cumsum(-1) - sorted_p >= top_p
        p = torch.zeros_like(p).scatter_(-1, order, sorted_p.masked_fill(drop, 0.0))
        p = p / p.sum(-1, keepdim=True)
    return p


def multinomial(p: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw from each distribution of p (..., V): (...) token ids."""
    flat = p.reshape(-1, p.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(p.shape[:-1])


def sample_from_logits(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Draw a token from each row of logits (..., V); temperature 0 means argmax."""
    if temperature == 0:
        return logits.argmax(-1)
    return multinomial(probs_from_logits(logits, temperature, top_k, top_p), generator)


@dataclass(frozen=True)
class Sampling:
    """How tokens are chosen: greedy (temperature 0) or sampling from the filtered softmax."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return probs_from_logits(logits, self.temperature, self.top_k, self.top_p)

    def choose(self, logits: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        return sample_from_logits(logits, self.temperature, self.top_k, self.top_p, generator)
