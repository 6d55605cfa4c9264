"""What a verify forward accepts: the exact rules for a chain of drafts and for a tree.

Speculative sampling is exact with respect to the filtered target distribution p =
`Sampling.probs(head-1 logits)`, the distribution plain sampling draws from:
- a chain (heads 2..K or a draft model) draws drafts from a proposal q and accepts each with
  min(1, p/q); on rejection it resamples from norm(max(0, p - q)) (Leviathan et al. 2023, Chen
  et al. 2023);
- a tree proposes deterministic candidates (the top-k of each head). With point-mass proposals
  the optimal exact rule is: draw x ~ p at a node and move to the child whose token is x, if any.
  Sampling x at every node in parallel and walking from the root is the same as drawing each
  token of the path from p in turn, so the output is exactly distributed as plain sampling.
Greedy is the temperature-0 case of the same rules (x = argmax p), so speculative greedy output is
plain greedy output token for token.
"""

from __future__ import annotations

import torch

from mtp.decoding.sampling import Sampling, multinomial
from mtp.decoding.tree import TreeTensors

__all__ = ["accept_chain", "accept_tree"]


def accept_chain(
    logits: torch.Tensor,
    drafts: torch.Tensor,
    q: torch.Tensor | None,
    sampling: Sampling,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept the longest valid prefix of a chain of drafts, plus one token from the target.

    Args:
        logits: target logits (B, n+1, V) at [pending, d_1, ..., d_n]; row j predicts d_{j+1}.
        drafts: (B, n).
        q: proposal probabilities the drafts were drawn from (B, n, V); None when greedy.

    Returns:
        a (B,) accepted drafts per row, and the next token (B,): head 1's choice after d_a, or
        on a rejection the resample from norm(max(0, p - q)).
    """
    b, n = drafts.shape
    rows = torch.arange(b, device=drafts.device)
    if n == 0:
        return torch.zeros_like(rows), sampling.choose(logits[:, 0], generator)
    if sampling.greedy:
        choice = logits.argmax(-1)  # (B, n+1)
        a = (drafts == choice[:, :n]).long().cumprod(1).sum(1)
        return a, choice[rows, a]
    p = sampling.probs(logits)  # (B, n+1, V)
    p_d = p[:, :n].gather(-1, drafts[..., None])[..., 0]  # (B, n)
    q_d = q.gather(-1, drafts[..., None])[..., 0]
    u = torch.rand(b, n, device=drafts.device, generator=generator)
    a = (u * q_d < p_d).long().cumprod(1).sum(1)  # accept d_j with probability min(1, p/q)
    target = p[rows, a]  # (B, V)
    # Rows that rejected d_{a+1} draw from the residual; rows that accepted all draw from p.
    q_pad = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)  # (B, n+1, V)
    residual = (target - q_pad[rows, a]).clamp(min=0)
    mass = residual.sum(-1, keepdim=True)
    # mass is 0 only if p == q, where a rejection has probability 0; fall back to p anyway.
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), target)
    target = torch.where((a < n)[:, None], residual, target)
    return a, multinomial(target, generator)


def accept_tree(
    logits: torch.Tensor,
    node_tokens: torch.Tensor,
    tt: TreeTensors,
    sampling: Sampling,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Walk the tree from the root, following the child whose token the target chose.

    Args:
        logits: target logits (B, N+1, V) at every node.
        node_tokens: (B, N+1), root first.

    Returns:
        The deepest accepted node (B,) and the next token (B,): the target's choice there.
    """
    choice = sampling.choose(logits, generator)  # (B, N+1): x ~ p (or argmax) at every node
    ok = node_tokens == choice[:, tt.parent]  # (B, N+1): the parent chose this node's token
    ok[:, 0] = True
    ok = ok[:, tt.path].all(-1)  # (B, N+1): every token on the path root..j was chosen
    # The heads' siblings hold distinct tokens, so their accepted nodes form one chain. A prompt
    # lookup branch may repeat a sibling's token (greedy only: both chains are then greedy's
    # tokens). Take the deepest accepted node.
    last = torch.where(ok, tt.depth + 1, 0).argmax(1)  # (B,)
    return last, choice[torch.arange(len(last), device=last.device), last]
