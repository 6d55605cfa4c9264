"""The decode loop, written once: prefill, then rounds of propose, verify, accept, advance.

Every decoder is this loop with one drafter (`mtp.decoding.drafters`): plain decoding proposes
nothing, self-speculation proposes a chain or a tree from heads 2..h, `draft` a chain from a
separate model, `oracle` the tokens greedy will emit. A round:

1. propose: the drafter's tokens (B, T), the pending token first, with their position offsets
   and which of them each one sees (a causal chain or a tree's ancestors);
2. verify: one cached forward of the trunk and head 1 over them;
3. accept: the exact rule for a chain or a tree (`mtp.decoding.acceptance`);
4. advance: the drafter takes in the committed tokens (`Drafter.advance`: heads 2..h draft the
   next round from there), the cache lengths move past them, the stopper takes each row's new
   tokens (`_emit`; with their origins where `generate`'s `on_tokens` listens, the streaming
   hook: `mtp.decoding.origin`), and finished rows leave the batch.

A token is *committed* once acceptance keeps it: it belongs to the output, and its keys and
values stay in the cache (a tree's accepted path is moved to contiguous slots by `_accept`).

Batches. Rows keep their own positions: prompts of different lengths are right-padded for the
prefill only, those far apart in length in forwards of their own (`length_groups`; the padding
lands in cache slots past each row's length, which no mask ever opens),
and afterwards each row writes at its own slots `lengths[b] + j`. Slot == RoPE position on the
committed path, so no row's positions are shifted by padding, and rows accept different numbers
of tokens per round. Finished rows leave the batch, so the batch only pays for live rows (a
live row from the end takes each one's place: `fill_order`, `KVCache.keep`).

Invariant between rounds: the cache holds every committed token but the last one, `pending`,
which is the first input of the next forward (so a forward never recomputes a token).

NOTE: the loop is not compiled. On a CPU, `torch.compile` (inductor, weights frozen) of the
verify forward compiles for tens of seconds per shape, and rounds come in many shapes, while the
compiled forward is a little faster than eager for one token and slower for several: it does
not pay there. With oracle drafts a round costs about what a bare forward over its tokens costs
(`mtp bench decode --oracle`), so the loop's own work is not where the time goes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtp.decoding.acceptance import accept_chain, accept_tree
from mtp.decoding.origin import HEAD_1
from mtp.decoding.sampling import Sampling
from mtp.decoding.stats import DecodeStats, Timer
from mtp.decoding.stopper import Stopper
from mtp.decoding.tree import TreeTensors
from mtp.model.transformer import KVCache, MTPTransformer

__all__ = ["Context", "Proposal", "Trunk", "Verified", "fill_order", "forward", "length_groups",
           "new_cache", "prefill", "run"]

Trunk = tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]
"""A forward's trunk output (B, T, d) and its rotary tables, from which draft heads run."""


@dataclass
class Context:
    """What the loop and every drafter share for one `generate` call."""

    model: MTPTransformer
    cache: KVCache
    sampling: Sampling
    stopper: Stopper
    timer: Timer
    stats: DecodeStats
    generator: torch.Generator | None
    context_len: int  # positions a sequence may fill: max_seq_len (of target and draft model)
    rows: list[int]  # the prompt index of each live batch row

    def room(self, most: int) -> int:
        """Drafts a round may verify: at most `most`, no position past the context length, and
        no more than the longest row can still use (the round adds one token of its own)."""
        room = self.context_len - 1 - int(self.cache.lengths.max())  # pending sits at lengths[b]
        need = max(self.stopper.remaining(r) for r in self.rows) - 1
        return max(0, min(most, room, need))


@dataclass
class Proposal:
    """A round's tokens to verify."""

    tokens: torch.Tensor  # (B, T): the pending token, then the drafts or tree nodes
    n: int  # drafts per row: the chain's length or the tree's depth
    tree: TreeTensors | None = None  # None: a chain, tokens[:, 1:] in order
    q: torch.Tensor | None = None  # (B, n, V): the chain's proposal distribution when sampling
    # (>= T,): each node's origin (`mtp.decoding.origin`), node j's at j, the root's HEAD_1; it
    # may run past T (a drafter keeps one for its longest round). None: nothing drafted.
    origins: torch.Tensor | None = None


@dataclass
class Verified:
    """What a round accepted, for the drafter to take in (`Drafter.advance`)."""

    proposal: Proposal
    trunk: Trunk  # of the verify forward, at every proposed token
    path: torch.Tensor  # (B, t): the committed proposal indices in order, padded with the last
    accepted: torch.Tensor  # (B,) drafts accepted per row; path[b, accepted[b]] is the last
    next_token: torch.Tensor  # (B,) the verifier's token after them: the next pending token
    emitted: list[list[int]]  # each row's new tokens: the accepted drafts, then next_token
    origins: list[list[int]] | None  # each emitted token's origin, where a listener asked


# --------------------------------------------------------------------------------------------
# Cached forwards


def new_cache(model: MTPTransformer, batch: int, max_len: int) -> KVCache:
    """A cache for `batch` rows of `max_len` slots, in the model's dtype; on a CPU in fp32
    whatever the model's, so that attention runs in fp32 there: the CPU's bf16 attention kernel
    is slower than its fp32 one, 2.5x at 64 rows, and reading a bf16 cache costs a conversion
    per layer and step."""
    p = next(model.parameters())
    dtype = torch.float32 if p.device.type == "cpu" else p.dtype
    return KVCache(model.cfg, batch, max_len, device=p.device, dtype=dtype)


def chain_mask(lengths: torch.Tensor, t: int) -> torch.Tensor:
    """Attention mask (B, 1, T, S) of a chain of T new tokens at slots lengths[b] + 0..T-1: each
    sees its row's committed slots and the new tokens up to itself. S = max(lengths) + T, so
    attention reads only the slots in use."""
    s = int(lengths.max()) + t
    last = lengths[:, None] + torch.arange(t, device=lengths.device)  # (B, T): own slot
    return (torch.arange(s, device=lengths.device) <= last[..., None])[:, None]


def tree_mask(lengths: torch.Tensor, template: torch.Tensor) -> torch.Tensor:
    """Attention mask (B, 1, T, S) of T new tokens at slots lengths[b] + 0..T-1 that see their
    row's committed slots and, among themselves, what template (T, T) allows (a tree's
    ancestors)."""
    t = template.shape[0]
    s = int(lengths.max()) + t
    rel = torch.arange(s, device=lengths.device) - lengths[:, None]  # (B, S) slot - first new
    # Column t of the padded template is all False: slots past a row's new tokens stay closed.
    padded = torch.cat([template, template.new_zeros(t, 1)], dim=1)  # (T, T+1)
    inside = padded[:, rel.clamp(0, t)].transpose(0, 1)  # (B, T, S)
    return ((rel < 0)[:, None, :] | inside)[:, None]


def forward(
    model: MTPTransformer,
    cache: KVCache,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    mask: torch.Tensor,
) -> tuple[torch.Tensor, Trunk]:
    """Trunk and head 1 over tokens (B, T), their keys and values written at slots lengths +
    0..T-1 (the lengths do not advance: the caller decides what stays).

    Returns head 1's normalised hidden state (B, T, d) and the trunk output.
    """
    slots = cache.lengths[:, None] + torch.arange(tokens.shape[1], device=tokens.device)
    h, rope = model.trunk(tokens, positions=positions, cache=cache, slots=slots, mask=mask)
    hidden = model.head_norm(model.head_output(0, h, rope, cache=cache, slots=slots, mask=mask))
    return hidden, (h, rope)


#: A prefill forward's fixed cost, in prompt tokens: prompts whose padding to one length would
#: cost more than another forward are prefilled apart (`length_groups`).
GROUP_COST = 64


def length_groups(lengths: list[int], cost: int = GROUP_COST) -> list[list[int]]:
    """The rows of prompts of these `lengths`, grouped for prefill forwards: each group padded
    to its longest prompt, the groups minimising the tokens run plus `cost` per forward (one
    group where the prompts are about as long). Groups of neighbours in length order, found
    by dynamic programming over that order."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    best, cut = [0] + [float("inf")] * len(order), [0] * (len(order) + 1)
    for j in range(1, len(order) + 1):  # the best grouping of the j shortest
        longest = lengths[order[j - 1]]
        for i in range(j):
            total = best[i] + (j - i) * longest + cost
            if total < best[j]:
                best[j], cut[j] = total, i
    groups, j = [], len(order)
    while j:
        groups.append(order[cut[j]:j])
        j = cut[j]
    return groups[::-1]


def prefill(model: MTPTransformer, cache: KVCache,
            prompts: list[list[int]]) -> tuple[torch.Tensor, Trunk]:
    """Run the prompts through the trunk and head 1, right-padded: prompts of about one length
    in one forward, prompts far apart in length in a forward per group (`length_groups`), so
    that a batch does not pay for padding short prompts to its longest.

    Returns head 1's hidden state at each row's last prompt token (B, d) and the trunk output
    at every prompt position (B, T, width), padded. Afterwards the cache lengths are the prompt
    lengths.
    """
    device = cache.k.device
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    t = int(lengths.max())
    tokens = torch.zeros(len(prompts), t, dtype=torch.long, device=device)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = torch.tensor(p, device=device)
    positions = torch.arange(t, device=device).expand(len(prompts), -1)
    cache.truncate(torch.zeros_like(lengths))
    groups = length_groups(lengths.tolist(), GROUP_COST)
    if len(groups) == 1:
        hidden, trunk = forward(model, cache, tokens, positions, chain_mask(cache.lengths, t))
        cache.truncate(lengths)
        return hidden[torch.arange(len(prompts), device=device), lengths - 1], trunk
    last = h = None  # (B, d), (B, T, width), allocated as the first group's outputs are
    for rows in groups:
        idx = torch.tensor(rows, device=device)
        tg = int(lengths[idx].max())
        part = KVCache(model.cfg, len(rows), tg, device=device, dtype=cache.k.dtype)
        hidden, (hg, _) = forward(model, part, tokens[idx, :tg], positions[idx, :tg],
                                  chain_mask(part.lengths, tg))
        cache.k[:, idx, :, :tg], cache.v[:, idx, :, :tg] = part.k, part.v
        if h is None:
            last, h = hidden.new_empty(len(prompts), hidden.shape[-1]), hg.new_zeros(
                len(prompts), t, hg.shape[-1])
        last[idx] = hidden[torch.arange(len(rows), device=device), lengths[idx] - 1]
        h[idx, :tg] = hg
    cache.truncate(lengths)
    return last, (h, model.rotary(positions))


# --------------------------------------------------------------------------------------------
# The loop


def _verify(ctx: Context, prop: Proposal) -> tuple[torch.Tensor, Trunk]:
    """The verify forward: head-1 logits (B, T, V) at every proposed token."""
    cache, t = ctx.cache, prop.tokens.shape[1]
    if prop.tree is None:
        positions = cache.lengths[:, None] + torch.arange(t, device=prop.tokens.device)
        mask = chain_mask(cache.lengths, t)
    else:
        positions = cache.lengths[:, None] + prop.tree.depth  # a node's position is its depth
        mask = tree_mask(cache.lengths, prop.tree.ancestors)
    ctx.timer.lap("cache")
    hidden, trunk = forward(ctx.model, cache, prop.tokens, positions, mask)
    logits = ctx.model.unembed(hidden)
    ctx.timer.lap("verify")
    return logits, trunk


def _accept(ctx: Context, prop: Proposal, logits: torch.Tensor, trunk: Trunk) -> Verified:
    """Apply the acceptance rule; a tree's accepted path moves to contiguous cache slots."""
    if prop.tree is None:
        a, nxt = accept_chain(logits, prop.tokens[:, 1:], prop.q, ctx.sampling, ctx.generator)
        full, toks = None, prop.tokens  # the accepted tokens are the first a + 1
    else:
        last, nxt = accept_tree(logits, prop.tokens, prop.tree, ctx.sampling, ctx.generator)
        a = prop.tree.depth[last]
        full = prop.tree.path[last]  # (B, D+1): root .. last, padded with last
        toks = prop.tokens.gather(1, full)
    # One host transfer for the round's tokens and counts, and for a listener only
    # (`Stopper.listening`) the origins of the committed tokens: unheard, they cost nothing.
    parts, w = [toks, nxt[:, None], a[:, None]], toks.shape[1]
    listening = ctx.stopper.listening
    if listening and prop.n:  # (a round that drafted nothing accepted no draft)
        origins = prop.origins[: prop.tokens.shape[1]]
        parts.append(origins.expand(len(toks), -1) if full is None else origins[full])
    host = torch.cat(parts, dim=1).tolist()
    # A row: the committed tokens (w of them), the verifier's token, the number of drafts
    # accepted, then where listened to the committed tokens' origins (w).
    emitted = [r[1 : 1 + r[w + 1]] + [r[w]] for r in host]
    heard = [r[w + 3 : w + 3 + r[w + 1]] + [HEAD_1] for r in host] if listening else None
    top = max(r[w + 1] for r in host)
    ctx.timer.lap("accept")
    if full is None:
        path = torch.arange(top + 1, device=a.device).expand(len(host), -1)
    else:
        path = full[:, : top + 1]
        # Padding copies land past the new length, where nothing reads them.
        ctx.cache.compact(ctx.cache.lengths[:, None] + path, ctx.cache.lengths)
        ctx.timer.lap("cache")
    return Verified(prop, trunk, path, a, nxt, emitted, heard)


def _emit(ctx: Context, emitted: list[list[int]], origins: list[list[int]] | None,
          first: int = 0) -> torch.Tensor | None:
    """Hand each row's new tokens (and their origins, where a listener asked) to the stopper and
    count the round; returns the batch indices of the rows that go on if some finished (else
    None). `emitted` is that of rows first.. (the rows before, which emit nothing, go on)."""
    alive, kept = list(range(first)), []
    lengths = ctx.cache.lengths.tolist()[first:]
    for i, (row, toks, n_cached) in enumerate(zip(ctx.rows[first:], emitted, lengths,
                                                  strict=True), first):
        n, done = ctx.stopper.extend(row, toks, None if origins is None else origins[i - first])
        kept.append(n)
        # A row whose sequence fills the context length (cache + pending token) also ends.
        if not done and n_cached + 1 < ctx.context_len:
            alive.append(i)
        else:
            ctx.stopper.end(row)
    ctx.stats.count(kept)
    if len(alive) == len(ctx.rows):
        return None
    alive = fill_order(alive)
    ctx.rows = [ctx.rows[i] for i in alive]
    return torch.tensor(alive, dtype=torch.long, device=ctx.cache.lengths.device)


def _join(ctx: Context, prompts: list[list[int]], new: list[int],
          pending: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Prefill prompts `new` (their indices) in a cache of their own and append their rows to
    the batch's; returns every row's pending token and, if some new row ended on its first
    token, the rows that go on."""
    part = KVCache(ctx.model.cfg, len(new), max(len(prompts[i]) for i in new),
                   device=pending.device, dtype=ctx.cache.k.dtype)
    hidden, _ = prefill(ctx.model, part, [prompts[i] for i in new])
    ctx.timer.lap("prefill")
    chosen = ctx.sampling.choose(ctx.model.unembed(hidden), ctx.generator)
    ctx.timer.lap("accept")
    ctx.cache.join(part)
    ctx.timer.lap("cache")
    old = len(ctx.rows)
    ctx.rows += new
    ctx.stats.prefills += len(new)
    heard = [[HEAD_1]] * len(new) if ctx.stopper.listening else None
    return torch.cat([pending, chosen]), _emit(ctx, [[t] for t in chosen.tolist()], heard, old)


def fill_order(alive: list[int]) -> list[int]:
    """The batch rows that go on (`alive`, ascending), in the order that moves the fewest: a row
    keeps its place where it can, and a finished row's place among the first len(alive) goes to
    a live row from past them, so that `KVCache.keep` copies one row per row that finished."""
    n = len(alive)
    movers = [i for i in alive if i >= n]
    staying = set(alive)
    return [i if i in staying else movers.pop() for i in range(n)]


#: With continuous batching, prompts waiting join the batch once this share of its rows is free:
#: a prefill forward per few rows rather than per row.
JOIN_SHARE = 1 / 8


def run(ctx: Context, prompts: list[list[int]], drafter, policy) -> None:
    """Decode every prompt to its end with `drafter`, `policy` choosing each round's drafts.

    Prompts beyond the cache's rows wait (continuous batching, for a drafter that keeps no state
    per row: plain decoding): the first rows are prefilled together, and once a `JOIN_SHARE` of
    the rows is free (or every prompt waiting fits), the next prompts are prefilled in a forward
    of their own and join the batch in the places of rows that ended (`_join`), so that a long
    queue of prompts is decoded with full batches to its last ones.
    """
    rows = ctx.cache.k.shape[1]
    waiting = list(range(len(prompts) - 1, rows - 1, -1))  # popped from the end: in order
    ctx.rows = list(range(min(rows, len(prompts))))
    hidden, trunk = prefill(ctx.model, ctx.cache, prompts[:rows])
    ctx.timer.lap("prefill")
    pending = ctx.sampling.choose(ctx.model.unembed(hidden), ctx.generator)  # (B,)
    ctx.timer.lap("accept")
    drafter.start(ctx, prompts[:rows], trunk, pending)
    ctx.stats.prefills += len(ctx.rows)
    first = [[HEAD_1]] * len(ctx.rows) if ctx.stopper.listening else None
    keep = _emit(ctx, [[t] for t in pending.tolist()], first)
    while ctx.rows or waiting:
        start = ctx.timer.lap()
        if keep is not None:
            ctx.cache.keep(keep)
            drafter.keep(keep)
            pending = pending[keep]
            keep = None
        free = rows - len(ctx.rows)
        if waiting and free and (free >= rows * JOIN_SHARE or free >= len(waiting)):
            new = [waiting.pop() for _ in range(min(free, len(waiting)))]
            pending, keep = _join(ctx, prompts, new, pending)
            continue  # rows that ended on their first token leave first
        n = policy.choose(ctx, drafter.max_drafts)
        prop = drafter.propose(ctx, pending, n)
        logits, trunk = _verify(ctx, prop)
        v = _accept(ctx, prop, logits, trunk)
        drafter.advance(ctx, v)
        # The cache keeps the round's committed tokens: the old pending one, the accepted drafts.
        ctx.cache.truncate(ctx.cache.lengths + v.accepted + 1)
        ctx.timer.lap("cache")
        pending = v.next_token
        keep = _emit(ctx, v.emitted, v.origins)
        ctx.stats.count_drafts(prop.n, [len(e) - 1 for e in v.emitted])
        seconds = ctx.timer.lap() - start
        ctx.stats.round_seconds.setdefault(tuple(prop.tokens.shape), []).append(seconds)
        policy.observe(prop, seconds - drafter.deferred)
        drafter.deferred = 0.0
    policy.finish(ctx)
