"""What a verify forward costs on this machine, measured rather than assumed.

A round's tokens per second is its expected new tokens over its time, and most of that time is
the verify forward: the trunk and head 1 over the pending token and the drafts, then head 1's
unembedding at each. How that time grows with the tokens verified depends on the machine (cores,
cache sizes, matrix units), the thread count and the model, so a dynamic tree chooses its size
from a measurement: `verify_seconds` times the forward once per model, batch size and thread
count (a fraction of a second for a small model), on a scratch cache, and keeps the result.
"""

from __future__ import annotations

import time
import weakref

import torch

from mtp.decoding.engine import chain_mask, forward, new_cache
from mtp.model.transformer import MTPTransformer

__all__ = ["cost_lines", "verify_seconds"]

#: Token counts timed; the others are interpolated between them.
_GRID = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
#: Cached positions the timed forward attends over: a prompt's worth, as most rounds see.
_CONTEXT = 128
_measured: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@torch.no_grad()
def verify_seconds(model: MTPTransformer, batch: int, most: int, *,
                   repeats: int = 5) -> list[float]:
    """seconds[t - 1]: one verify forward over t = 1..most tokens per row, for `batch` rows.

    Measured at the token counts of a fixed grid up to `most`, linearly interpolated between
    them, and kept per model, batch size, thread count and `most`. The grid is timed `repeats`
    times over, a pass through every count at a time, so that a stretch of a slower machine
    (another process, a clock change) falls on all counts alike; each count keeps its fastest
    time, and then the fastest time of any count at or above it: a forward over more tokens is
    never charged less than one over fewer, and a slow outlier does not cut a tree short. Call
    it where decoding runs (inside `mtp.decoding.arithmetic.decode_linears`), so that the
    forward timed is the one rounds will run.
    """
    key = (batch, most, torch.get_num_threads())
    kept = _measured.setdefault(model, {})
    if key in kept:
        return kept[key]
    device = next(model.parameters()).device
    context = min(_CONTEXT, model.cfg.max_seq_len - most - 1)
    if context < 0:
        raise ValueError(f"a verify forward over {most} tokens does not fit the context length "
                         f"({model.cfg.max_seq_len})")
    cache = new_cache(model, batch, context + most)
    cache.truncate(torch.full((batch,), context, device=device))

    def run(t: int) -> None:
        tokens = torch.zeros(batch, t, dtype=torch.long, device=device)
        positions = cache.lengths[:, None] + torch.arange(t, device=device)
        hidden, _ = forward(model, cache, tokens, positions, chain_mask(cache.lengths, t))
        model.unembed(hidden)

    grid = sorted({t for t in _GRID if t < most} | {most})
    run(most)  # a first call pays for allocations the rounds will not
    timed = dict.fromkeys(grid, float("inf"))
    for _ in range(repeats):
        for t in grid:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            run(t)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            timed[t] = min(timed[t], time.perf_counter() - start)
    for lo, hi in zip(grid[-2::-1], grid[:0:-1]):  # from the top: never above a larger count's
        timed[lo] = min(timed[lo], timed[hi])
    seconds = []
    for t in range(1, most + 1):
        hi = min(g for g in grid if g >= t)
        lo = max((g for g in grid if g <= t), default=hi)
        w = 0.0 if hi == lo else (t - lo) / (hi - lo)
        seconds.append(timed[lo] + w * (timed[hi] - timed[lo]))
    kept[key] = seconds
    return seconds


def cost_lines(model: MTPTransformer) -> list[str]:
    """What `verify_seconds` measured for `model` so far, a line per batch size, thread count
    and most tokens: the forward's ms over one token, and over t tokens as a multiple of it."""
    lines = []
    for (batch, most, threads), seconds in sorted(_measured.get(model, {}).items()):
        ratios = ", ".join(f"{t}: {seconds[t - 1] / seconds[0]:.2f}x" for t in _GRID if t <= most)
        lines.append(f"verify forward (batch {batch}, {threads} threads): {1000 * seconds[0]:.1f} "
                     f"ms over 1 token; over t tokens, t: {ratios}")
    return lines
