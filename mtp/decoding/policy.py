"""How many drafts a round verifies: all it can (`Fixed`) or as many as pay (`Adaptive`)."""

from __future__ import annotations

from mtp.decoding.engine import Context, Proposal

__all__ = ["Adaptive", "Fixed"]


class Fixed:
    """Every round verifies the drafter's most drafts, cut only near the end of the window or of
    the longest row."""

    def choose(self, ctx: Context, most: int) -> int:
        return ctx.room(most)

    def observe(self, prop: Proposal, seconds: float) -> None:
        """A round with `prop` took `seconds`; its acceptance is in the call's stats."""


class Adaptive(Fixed):
    """Each round verifies the number of drafts n that maximises expected tokens per second.

    Expected new tokens of a row for n drafts are E(n) = 1 + sum_{i <= n} prod_{j <= i} a_j,
    where a_j is the rate at which the draft at depth j was accepted given every earlier one was
    (the call's `DecodeStats`, starting from a prior of `prior` worth `prior_weight` rounds). The
    cost c(B, n) of a round at batch size B is the running mean of the rounds measured at that
    (B, n). Each batch size first tries every n once, then rounds take the n of largest
    B * E(n) / c(B, n); every `probe_every` rounds one other n is tried again, so costs and
    acceptance stay measured when the best choice changes (rows leave the batch, acceptance
    drifts). n = 0 is plain decoding: where speculation does not pay, rounds stop drafting, and
    heads 2..h stop running until drafts are wanted again (`HeadChain` catches them up then).
    """

    def __init__(self, prior: float = 0.5, prior_weight: float = 2.0, probe_every: int = 16,
                 smoothing: float = 0.3) -> None:
        self.prior, self.prior_weight = prior, prior_weight
        self.probe_every, self.smoothing = probe_every, smoothing
        self.cost: dict[tuple[int, int], float] = {}
        self.rounds = 0

    def expected_tokens(self, ctx: Context, n: int) -> float:
        """E(n): a row's expected new tokens from a round with n drafts."""
        offered, taken = ctx.stats.offered, ctx.stats.taken
        total, run = 1.0, 1.0
        for j in range(n):
            o, t = (offered[j], taken[j]) if j < len(offered) else (0, 0)
            run *= (t + self.prior * self.prior_weight) / (o + self.prior_weight)
            total += run
        return total

    def choose(self, ctx: Context, most: int) -> int:
        most = ctx.room(most)
        b = len(ctx.rows)
        self.rounds += 1
        untried = [n for n in range(most + 1) if (b, n) not in self.cost]
        if untried:
            return untried[-1]
        rate = {n: b * self.expected_tokens(ctx, n) / self.cost[b, n] for n in range(most + 1)}
        best = max(rate, key=rate.get)
        if most and self.rounds % self.probe_every == 0:
            return (best + 1 + self.rounds // self.probe_every % most) % (most + 1)
        return best

    def observe(self, prop: Proposal, seconds: float) -> None:
        key = (prop.tokens.shape[0], prop.n)
        old = self.cost.get(key)
        self.cost[key] = seconds if old is None else old + self.smoothing * (seconds - old)
