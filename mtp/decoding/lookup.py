"""Prompt lookup: drafts copied from the text so far, free of any model.

Code repeats itself: an answer restates the prompt's signature, names recur, a test re-reads the
function's arguments. Prompt lookup (Saxena 2023; transformers' `prompt_lookup_num_tokens`)
drafts the tokens that followed an earlier occurrence of the sequence's last n tokens. Here the
latest earlier occurrence is taken (the nearest context), trying n = `ngram` down to 1.

`LookupChain` drafts with it alone (decoder `lookup`). With heads, `ParallelHeadsTree` verifies
the lookup's continuation as one more branch from the root beside the heads' chain or tree
(`generate(..., lookup=N)`): a round keeps whichever branch the target agrees with longer.

Beside a dynamic tree the branch is sized like the tree, by what its tokens are worth against
their forward time (`LookupWorth`, `DynamicTree.choose`): on a CPU whose forward over ten more
tokens costs a few percent a round verifies all of them, on one where it costs forty percent
only those likely to add a token the heads' tree would not. What they add is learnt per kind of
match (the n-gram length, and whether the branch starts with the heads' own first draft).
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
    matched: list[int] = field(default_factory=list)
    """The n-gram length each row's latest continuation matched (0: none)."""

    def start(self, prompts: list[list[int]]) -> None:
        self.prompts = prompts

    def continuations(self, ctx: Context, most: int) -> list[list[int]]:
        """Each live row's continuation, at most min(most, tokens) long (maybe empty); the
        length of the n-gram each one matched goes to `matched` (0: none)."""
        most = min(most, self.tokens)
        found = [match(self.prompts[r] + ctx.stopper.out[r], most, self.ngram) for r in ctx.rows]
        self.matched = [n for _, n in found]
        return [tokens for tokens, _ in found]

    def worth(self, scored: dict, by_kind: bool = True) -> LookupWorth:
        """A learner of what each token of this lookup's branch adds beside a dynamic tree,
        keeping its scored rounds in `scored` (the decode's `DecodeStats.lookup_worth`), per
        kind of match unless `by_kind` is False (the ablation: all rounds pooled)."""
        return LookupWorth(self, scored, by_kind)

    def padded(self, ctx: Context, most: int, device: torch.device) -> torch.Tensor:
        """The continuations as a (B, m) tensor, m the longest (`pad`)."""
        return self.pad(self.continuations(ctx, most), device)

    @staticmethod
    def pad(rows: list[list[int]], device: torch.device, m: int | None = None) -> torch.Tensor:
        """Continuations as a (B, m) tensor, m the longest where not given: longer rows are
        cut, shorter ones padded with token 0, which verification treats like any draft
        (accepted only where right)."""
        m = max(map(len, rows), default=0) if m is None else m
        return torch.tensor([(r + [0] * m)[:m] for r in rows], dtype=torch.long,
                            device=device).view(len(rows), m)


#: What `LookupWorth` takes each branch token to add before it has seen any (worth one round).
PRIOR_GAIN = 0.5
#: How many rounds of a match kind its own estimate takes to outweigh the pooled one.
KIND_PRIOR = 2.0


class LookupWorth:
    """What each token of lookup's branch adds to a round beside the heads' tree, learnt as a
    decode goes: the chance, for i = 1..tokens, that the branch's first i tokens are right while
    the tree's own accepted path is shorter than i, which is what the i-th token adds to the
    tokens a round accepts. Every round's continuation is scored, verified or not, once the text
    has gone past it, so a branch cut short still learns what a longer one would have added.

    A branch's worth depends on its match (`Lookup.continuations`): one after a 2-gram repeats
    the text more surely than one after a single token, and one whose first token is the heads'
    own first draft adds only where it runs past their tree, while one that contradicts them
    adds where they are wrong. With `by_kind`, a kind (the n-gram length matched, and whether
    the branch's first token is the heads' likeliest) keeps its own estimate, drawn towards the
    pooled one by `KIND_PRIOR` rounds' weight until its rounds outweigh it."""

    def __init__(self, lookup: Lookup, scored: dict[tuple[int, bool], tuple[list[int], list[int]]],
                 by_kind: bool = True) -> None:
        self.lookup, self.by_kind = lookup, by_kind
        # kind -> (rounds, added): at each position, the scored rounds whose continuation
        # reached it and the tokens it added (`DecodeStats.lookup_worth`)
        self.scored = scored
        # Rounds not scored yet: row, the text's length at the round, its continuation, its
        # match kind and the tree's own accepted length.
        self.open: list[tuple[int, int, list[int], tuple[int, bool], int]] = []
        self.rows: list[list[int]] = []  # the current round's continuations
        self.row_kinds: list[tuple[int, bool]] = []  # and their kinds

    def gains(self, rows: list[list[int]], first: list[int] | None = None) -> list[float]:
        """The gains of the branch of a round whose rows continue with `rows` (the latest
        `Lookup.continuations`), where the heads' first drafts are `first` (one per row, their
        likeliest token after the pending one; None: no heads): at position i, the mean over
        the rows of each one's estimate at i, 0 for a row without an i-th token (one branch for
        the batch)."""
        self.rows = rows
        self.row_kinds = [(n, bool(first is not None and r and r[0] == first[j]))
                          for j, (r, n) in enumerate(zip(rows, self.lookup.matched))]
        m = max(map(len, rows), default=0)
        return [sum(self._rate(k, i, pooled) for r, k in zip(rows, self.row_kinds) if len(r) > i)
                / len(rows) for i, pooled in enumerate(self._pooled(m))]

    def _pooled(self, m: int) -> list[float]:
        """Positions 1..m's estimates over every kind, each starting from `PRIOR_GAIN`."""
        rounds, added = [1.0] * m, [PRIOR_GAIN] * m
        for r, a in self.scored.values():
            for i in range(min(m, len(r))):
                rounds[i] += r[i]
                added[i] += a[i]
        return [a / r for r, a in zip(rounds, added)]

    def _rate(self, kind: tuple[int, bool], i: int, pooled: float) -> float:
        """Position i + 1's estimate for a branch of match kind `kind`, drawn towards the
        `pooled` one."""
        rounds, added = self.scored.get(kind, ((), ())) if self.by_kind else ((), ())
        if i >= len(rounds):
            return pooled
        return (added[i] + KIND_PRIOR * pooled) / (rounds[i] + KIND_PRIOR)

    def observe(self, ctx: Context, v, n_tree: int) -> None:
        """After a round whose heads' tree was the first `n_tree` nodes of `v.proposal`: note
        how far the tree alone would have gone, and score the rounds the text has passed."""
        tree = v.proposal.tree
        tokens = v.proposal.tokens[:, :n_tree].tolist()
        parent = tree.parent[:n_tree].tolist()
        out = ctx.stopper.out
        texts = {r: self.lookup.prompts[r] + out[r] + e for r, e in zip(ctx.rows, v.emitted)}
        for r, cont, kind, row_tokens, e in zip(ctx.rows, self.rows, self.row_kinds, tokens,
                                                v.emitted):
            start = len(texts[r]) - len(e)
            self.open.append((r, start, cont, kind, tree_accepted(row_tokens, parent, e)))
        still = []
        for r, start, cont, kind, a in self.open:
            text = texts.get(r)
            if text is None:  # the row has ended: what it wrote is all there is
                text = self.lookup.prompts[r] + out[r]
            elif len(text) - start < len(cont):
                still.append((r, start, cont, kind, a))
                continue
            if not cont:
                continue
            rounds, added = self.scored.setdefault(kind, ([], []))
            right = 0
            for i, tok in enumerate(cont[: len(text) - start]):
                right += right == i and tok == text[start + i]
                if i == len(rounds):
                    rounds.append(0)
                    added.append(0)
                rounds[i] += 1
                added[i] += right > i and a <= i
        self.open = still


def tree_accepted(tokens: list[int], parent: list[int], emitted: list[int]) -> int:
    """How many drafts a tree of nodes `tokens` (root first) with parents `parent` accepts on
    its own where the target's tokens are `emitted` (a round's accepted drafts, then the
    verifier's token): the depth of its deepest node along them."""
    node = depth = 0
    for tok in emitted:
        node = next((j for j in range(node + 1, len(tokens))
                     if parent[j] == node and tokens[j] == tok), 0)
        if not node:
            break
        depth += 1
    return depth


def match(seq: list[int], most: int, ngram: int) -> tuple[list[int], int]:
    """The up to `most` tokens that followed the latest earlier occurrence of seq's last n
    tokens, for the largest n <= ngram that occurs earlier, and that n; ([], 0) if none does."""
    if most <= 0:
        return [], 0
    for n in range(min(ngram, len(seq) - 1), 0, -1):
        tail = seq[-n:]
        last = tail[-1]
        # Occurrences start at i <= len(seq) - n - 1, so at least one token follows them.
        for i in range(len(seq) - n - 1, -1, -1):
            if seq[i + n - 1] == last and seq[i : i + n] == tail:
                return seq[i + n : i + n + most], n
    return [], 0


def continuation(seq: list[int], most: int, ngram: int) -> list[int]:
    """`match`'s tokens."""
    return match(seq, most, ngram)[0]


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
