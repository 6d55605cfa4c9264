"""How many drafts a round verifies: all it can (`Fixed`) or as many as pay (`Adaptive`)."""

from __future__ import annotations

from mtp.decoding.engine import Context, Proposal
from mtp.decoding.stats import add_counts

__all__ = ["Adaptive", "Fixed"]



class Fixed:
    """Every round verifies the drafter's most drafts, cut only near the end of the context or of
    the longest row."""

    def choose(self, ctx: Context, most: int) -> int:
        return ctx.room(most)

    def observe(self, prop: Proposal, seconds: float) -> None:
        """A round with `prop` took `seconds`; its acceptance is in the call's stats."""

    def finish(self, ctx: Context) -> None:
        """The call ended."""


class Adaptive(Fixed):
    """Each round verifies the number of drafts n that maximises expected tokens per second.

    Expected new tokens of a row for n drafts are E(n) = 1 + sum_{i <= n} prod_{j <= i} a_j,
    where a_j is the rate at which the draft at depth j was accepted given every earlier one was
    (the call's `DecodeStats`, starting from a prior of `prior` worth `prior_weight` rounds).
    The cost c(B, n) of a round at batch size B is an exponential moving average (weight
    `smoothing` on the newest) of the rounds measured at that (B, n); where a batch size has not
    tried some n, c(B, n) is scaled from the nearest batch size that has, by the ratio of a
    choice both measured. The first batch size tries every n once; later ones (rows leave the
    batch) only what they cannot estimate. Rounds then take the n of largest B * E(n) / c(B, n),
    and now and then try another n again (after 16 rounds, then twice as long each time the best
    choice holds), so costs and acceptance stay measured when the best choice changes. n = 0 is
    plain decoding: where speculation does not pay, rounds stop drafting, and heads 2..h stop
    running until drafts are wanted again (`ParallelHeads` catches them up then).

    One instance passed to many `generate` calls of the same model and drafter (as
    `adaptive=policy`) keeps its costs and acceptance from call to call, so a short call does
    not judge from its first few rounds alone.
    """

    def __init__(self, prior: float = 0.5, prior_weight: float = 2.0, probe_every: int = 16,
                 smoothing: float = 0.3) -> None:
        self.prior, self.prior_weight = prior, prior_weight
        self.probe_every, self.smoothing = probe_every, smoothing
        self.cost: dict[tuple[int, int], float] = {}
        self.next_probe, self.interval = probe_every, probe_every
        self.rounds, self.best = 0, None
        self.offered: list[int] = []  # acceptance of earlier calls (see DecodeStats)
        self.taken: list[int] = []

    def expected_tokens(self, ctx: Context, n: int) -> float:
        """E(n): a row's expected new tokens from a round with n drafts."""
        offered = add_counts(self.offered, ctx.stats.offered)
        taken = add_counts(self.taken, ctx.stats.taken)
        total, run = 1.0, 1.0
        for j in range(n):
            o, t = (offered[j], taken[j]) if j < len(offered) else (0, 0)
            run *= (t + self.prior * self.prior_weight) / (o + self.prior_weight)
            total += run
        return total

    def estimate(self, b: int, n: int) -> float | None:
        """c(b, n): measured, or scaled from the nearest batch size that measured n."""
        if (b, n) in self.cost:
            return self.cost[b, n]
        here = [m for bb, m in self.cost if bb == b]
        for other in sorted({bb for bb, m in self.cost if m == n}, key=lambda x: abs(x - b)):
            common = [m for m in here if (other, m) in self.cost]
            if common:
                m = common[0]
                return self.cost[b, m] * self.cost[other, n] / self.cost[other, m]
        return None

    def choose(self, ctx: Context, most: int) -> int:
        most = ctx.room(most)
        b = len(ctx.rows)
        self.rounds += 1
        cost = {n: self.estimate(b, n) for n in range(most + 1)}
        unknown = [n for n, c in cost.items() if c is None]
        if unknown:
            return self.best if self.best in unknown else unknown[-1]
        rate = {n: b * self.expected_tokens(ctx, n) / cost[n] for n in cost}
        best = max(rate, key=rate.get)
        if best != self.best:
            self.best, self.interval = best, self.probe_every
            self.next_probe = self.rounds + self.interval
        elif most and self.rounds >= self.next_probe:
            self.interval *= 2
            self.next_probe = self.rounds + self.interval
            return (best + 1 + self.rounds % most) % (most + 1)  # another n than the best
        return best

    def finish(self, ctx: Context) -> None:
        self.offered = add_counts(self.offered, ctx.stats.offered)
        self.taken = add_counts(self.taken, ctx.stats.taken)

    def observe(self, prop: Proposal, seconds: float) -> None:
        key = (prop.tokens.shape[0], prop.n)
        old = self.cost.get(key)
        self.cost[key] = seconds if old is None else old + self.smoothing * (seconds - old)
