"""Prompt lookup: drafts copied from the text so far, free of any model.

Code repeats itself: an answer restates the prompt's signature, names recur, a test re-reads the
function's arguments. Prompt lookup (Saxena 2023; transformers' `prompt_lookup_num_tokens`)
drafts the tokens that followed an earlier occurrence of the sequence's last n tokens. Here the
latest earlier occurrence is taken (the nearest context), trying n = `ngram` down to 1.

`LookupChain` drafts with it alone (decoder `lookup`). With heads, `ParallelHeadsTree` verifies
the lookup's continuation as one more branch from the root beside the heads' chain or tree
(`generate(..., lookup=N)`): a round keeps whichever branch the target agrees with longer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mtp.decoding.drafters import Drafter, chain_origins
from mtp.decoding.engine import Context, Proposal
from mtp.decoding.names import LOOKUP_TOKENS
from mtp.decoding.origin import LOOKUP

__all__ = ["Lookup", "LookupChain"]


@dataclass
class Lookup:
    """Up to `tokens` drafts per round from the latest earlier match of the last `ngram`..1
    tokens of each row's prompt and output."""

    tokens: int = LOOKUP_TOKENS
    ngram: int = 2
    prompts: list[list[int]] = field(default_factory=list)

    def start(self, prompts: list[list[int]]) -> None:
        self.prompts = prompts

    def continuations(self, ctx: Context, most: int) -> list[list[int]]:
        """Each live row's continuation, at most min(most, tokens) long (maybe empty)."""
        most = min(most, self.tokens)
        return [continuation(self.prompts[r] + ctx.stopper.out[r], most, self.ngram)
                for r in ctx.rows]

    def padded(self, ctx: Context, most: int, device: torch.device) -> torch.Tensor:
        """The continuations as a (B, m) tensor, m the longest; shorter rows are padded with
        token 0, which verification treats like any draft (accepted only where right)."""
        rows = self.continuations(ctx, most)
        m = max(map(len, rows), default=0)
        return torch.tensor([r + [0] * (m - len(r)) for r in rows], dtype=torch.long,
                            device=device).view(len(rows), m)


def continuation(seq: list[int], most: int, ngram: int) -> list[int]:
    """The up to `most` tokens that followed the latest earlier occurrence of seq's last n
    tokens, for the largest n <= ngram that occurs earlier; [] if none does."""
    if most <= 0:
        return []
    for n in range(min(ngram, len(seq) - 1), 0, -1):
        tail = seq[-n:]
        last = tail[-1]
        # Occurrences start at i <= len(seq) - n - 1, so at least one token follows them.
        for i in range(len(seq) - n - 1, -1, -1):
            if seq[i + n - 1] == last and seq[i : i + n] == tail:
                return seq[i + n : i + n + most]
    return []


class LookupChain(Drafter):
    """Drafts a chain by prompt lookup alone (no heads: any model, K = 1 included)."""

    def __init__(self, lookup: Lookup) -> None:
        self.lookup = lookup
        self.max_drafts = lookup.tokens

    def start(self, ctx, prompts, trunk, pending) -> None:
        self.lookup.start(prompts)
        self.origins = chain_origins(LOOKUP, self.max_drafts, pending.device)

    def propose(self, ctx, pending, n) -> Proposal:
        drafts = self.lookup.padded(ctx, n, pending.device)
        ctx.timer.lap("draft")
        return Proposal(torch.cat([pending[:, None], drafts], dim=1), drafts.shape[1],
                        origins=self.origins)
