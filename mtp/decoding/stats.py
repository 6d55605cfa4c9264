"""What a `generate` call did: counts, acceptance, and where the time went."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["PHASES", "DecodeStats", "Timer", "add_counts"]

#: Phases of the time split: the prefill, drafting (heads 2..K or the draft model, and choosing the
#: drafts), tree building (tree tokens and positions), the verify forward (trunk + head 1 +
#: unembedding), acceptance and sampling, and cache update (masks, rollback, compaction).
PHASES = ("prefill", "draft", "tree", "verify", "accept", "cache")


def add_counts(a: list[int], b: list[int]) -> list[int]:
    """Elementwise sum of two count lists of any lengths."""
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)]


@dataclass
class DecodeStats:
    """What one `generate` call did.

    L counts, per row, the tokens each target forward produced (the prefill included), so plain
    decoding has L = 1 and a batch's L is that of its rows together.
    """

    tokens: int = 0
    """New tokens returned, all rows together."""
    forwards: int = 0
    """Target-model forward passes (a batched forward counts once)."""
    row_forwards: int = 0
    """Target forwards summed over the rows that took part in them."""
    prefills: int = 0
    """Rows prefilled (each one's prefill forward produced its first token)."""
    draft_forwards: int = 0
    """Forward passes of the separate draft model (decoder `draft`)."""
    seconds: float = 0.0
    """Wall-clock time of the whole call."""
    time: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    """Seconds per phase (see `PHASES`); the rest of `seconds` is bookkeeping."""
    accepted: list[int] = field(default_factory=list)
    """accepted[n]: row-forwards that produced n tokens."""
    offered: list[int] = field(default_factory=list)
    """offered[i]: row-rounds whose draft at depth i + 1 was verified with every earlier draft
    accepted (the chance head i + 2's draft had to count)."""
    taken: list[int] = field(default_factory=list)
    """taken[i]: of those, the row-rounds that accepted it."""
    drafts_chosen: list[int] = field(default_factory=list)
    """drafts_chosen[n]: rounds that verified n drafts per row (a tree's n is its depth)."""
    round_seconds: dict[tuple[int, int], list[float]] = field(default_factory=dict)
    """Wall-clock seconds of each round after the prefill, keyed by the shape of its verify
    forward: (rows, tokens per row)."""
    lookup_worth: dict[tuple[int, bool], tuple[list[int], list[int]]] = field(
        default_factory=dict)
    """Beside a dynamic tree, lookup's scored rounds by kind of match (n-gram length, first
    token the heads' first draft or not: `mtp.decoding.lookup.LookupWorth`): at each position
    i, the rounds whose continuation reached it and the tokens its token i + 1 added."""

    @property
    def tokens_per_forward(self) -> float:
        """L: new tokens per row-forward."""
        return self.tokens / max(self.row_forwards, 1)

    @property
    def tokens_per_round(self) -> float:
        """New tokens per row-forward after the prefill: L in the steady state."""
        return (self.tokens - self.prefills) / max(self.row_forwards - self.prefills, 1)

    @property
    def ms_per_token(self) -> float:
        return 1000.0 * self.seconds / max(self.tokens, 1)

    @property
    def acceptance(self) -> list[float]:
        """Per depth: the rate a draft was accepted, given every earlier one was."""
        return [t / o if o else float("nan") for t, o in zip(self.taken, self.offered,
                                                              strict=True)]

    def add(self, other: DecodeStats) -> None:
        """Accumulate another call's counts and times into this one."""
        self.tokens += other.tokens
        self.forwards += other.forwards
        self.row_forwards += other.row_forwards
        self.prefills += other.prefills
        self.draft_forwards += other.draft_forwards
        self.seconds += other.seconds
        for k, v in other.time.items():
            self.time[k] = self.time.get(k, 0.0) + v
        self.accepted = add_counts(self.accepted, other.accepted)
        self.offered = add_counts(self.offered, other.offered)
        self.taken = add_counts(self.taken, other.taken)
        self.drafts_chosen = add_counts(self.drafts_chosen, other.drafts_chosen)
        for t, s in other.round_seconds.items():
            self.round_seconds.setdefault(t, []).extend(s)
        for kind, (rounds, added) in other.lookup_worth.items():
            mine = self.lookup_worth.get(kind, ([], []))
            self.lookup_worth[kind] = (add_counts(mine[0], rounds), add_counts(mine[1], added))

    def lookup_lines(self) -> list[str]:
        """`lookup_worth` as lines, a kind each: its rounds and what each position added."""
        lines = []
        for (n, agree), (rounds, added) in sorted(self.lookup_worth.items()):
            gains = " ".join(f"{a / r:.2f}" for r, a in zip(rounds, added))
            lines.append(f"{n}-gram match, first token {'=' if agree else '!='} the heads' "
                         f"first draft: {rounds[0]} rounds; tokens added by position {gains}")
        return lines

    def count(self, emitted: Sequence[int]) -> None:
        """Record one forward whose rows produced `emitted` tokens each."""
        self.forwards += 1
        self.row_forwards += len(emitted)
        for n in emitted:
            self.tokens += n
            if n >= len(self.accepted):
                self.accepted.extend([0] * (n + 1 - len(self.accepted)))
            self.accepted[n] += 1

    def count_drafts(self, n: int, accepted: Sequence[int]) -> None:
        """Record a round that verified n drafts per row, of which rows accepted `accepted`."""
        if n >= len(self.drafts_chosen):
            self.drafts_chosen.extend([0] * (n + 1 - len(self.drafts_chosen)))
        self.drafts_chosen[n] += 1
        if n > len(self.offered):
            self.offered.extend([0] * (n - len(self.offered)))
            self.taken.extend([0] * (n - len(self.taken)))
        for a in accepted:
            for i in range(min(a + 1, n)):
                self.offered[i] += 1
            for i in range(a):
                self.taken[i] += 1


class Timer:
    """Splits wall-clock time into phases: `lap(phase)` charges the time since the last lap to
    `phase`. One clock read per phase boundary; on CUDA it synchronises first, so times are
    the device's too."""

    def __init__(self, stats: DecodeStats, device: torch.device) -> None:
        self.time, self.cuda = stats.time, device.type == "cuda"
        self.last = time.perf_counter()

    def lap(self, phase: str | None = None) -> float:
        """Charge the time since the last lap to `phase` (None: to no phase); returns now."""
        if self.cuda:
            torch.cuda.synchronize()
        now = time.perf_counter()
        if phase is not None:
            self.time[phase] += now - self.last
        self.last = now
        return now
