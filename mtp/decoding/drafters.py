"""Drafters: what proposes a round's tokens to the loop of `mtp.decoding.engine`.

A drafter has four hooks: `start` (after the prefill), `propose` (a round's tokens, n drafts per
row), `advance` (after acceptance: move past the committed tokens, ready to propose the next
round) and `keep` (rows leave the batch).

- `Drafter` proposes nothing: plain greedy or sampling, one token per forward.
- `ParallelHeads`: heads 2..h, each reading the trunk output, draft a chain (blockwise parallel
  decoding, Stern et al. 2018).
- `ParallelHeadsTree`: the top-k of those heads form a candidate tree (Medusa), with prompt
  lookup's continuation as one more branch where asked (`mtp.decoding.lookup`);
  `ParallelHeadsDynamicTree` grows that tree anew each round where the heads are sure.
- `DraftModel`: a separate small model drafts a chain (Leviathan et al. 2023).
- `Oracle`: drafts the tokens greedy will emit; an upper bound that measures the loop's cost
  independently of how good the heads are.

Cascaded heads, each reading the one before, draft with `mtp.decoding.cascaded.CascadedHeads`.

Heads 2..h run only on the tokens a round committed, after acceptance: their caches then only
ever hold the committed sequence, and a tree forward does not pay the draft heads for its
rejected branches.

Each proposal says who proposed each node (`Proposal.origins`, `mtp.decoding.origin`): a node at
depth d of the heads' chain or tree is head d + 1's, a lookup branch's nodes are `LOOKUP`'s. A
drafter builds those codes once per shape, so a round pays nothing for them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from mtp.decoding.engine import (
    Context,
    Proposal,
    Trunk,
    Verified,
    chain_mask,
    forward,
    new_cache,
    prefill,
)
from mtp.decoding.origin import DRAFT_MODEL, HEAD_1, LOOKUP, ORACLE
from mtp.decoding.sampling import multinomial
from mtp.decoding.stacked import StackedLinear, stacked_heads
from mtp.decoding.tree import DynamicTree, Tree, TreeTensors
from mtp.model.transformer import MTPTransformer

__all__ = ["DraftModel", "DraftVocab", "Drafter", "Oracle", "ParallelHeads",
           "ParallelHeadsDynamicTree", "ParallelHeadsTree", "chain_origins", "tree_origins",
           "tree_tensors"]


class DraftVocab:
    """What heads 2..K draft from their normalised hidden states z (..., d): their likeliest
    tokens, with or without the chances, computed over the draft vocabulary alone where the
    model has one (`--model.draft_vocab`): its Vd unembedding rows, gathered once per decode
    into a linear layer that multiplies on the machine's chosen path like the model's own
    (`Drafter.layers`, `mtp.decoding.arithmetic.decode_linears`), and no (..., V) tensor of -inf
    besides. At batch 1 those were most of a draft level's cost: reading the rows through a
    general matrix product, and ranking the whole vocabulary. Only sampling, whose acceptance
    rule needs q over the whole vocabulary, takes `logits`."""

    def __init__(self, model: MTPTransformer) -> None:
        self.model = model
        self.linear = self.ids = None
        if model.cfg.draft_vocab:
            rows = model.head_unembed(1).detach()  # (Vd, d)
            self.linear = torch.nn.Linear(*rows.shape[::-1], bias=False, device=rows.device,
                                          dtype=rows.dtype)
            self.linear.weight = torch.nn.Parameter(rows, requires_grad=False)
            self.ids = model.draft_ids  # column -> token id

    def scores(self, z: torch.Tensor) -> torch.Tensor:
        """Logits (..., Vd) over the draft vocabulary (the whole one without it)."""
        return self.model.unembed(z) if self.linear is None else self.linear(z)

    def _tokens(self, columns: torch.Tensor) -> torch.Tensor:
        return columns if self.ids is None else self.ids[columns]

    def top(self, z: torch.Tensor, width: int) -> torch.Tensor:
        """The `width` likeliest tokens (..., width), likeliest first."""
        return self._tokens(self.scores(z).topk(width, dim=-1).indices)

    def top_chances(self, z: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The `width` likeliest tokens' probabilities and ids, each (..., width)."""
        probs, columns = self.scores(z).float().softmax(-1).topk(width, dim=-1)
        return probs, self._tokens(columns)

    def argmax(self, z: torch.Tensor) -> torch.Tensor:
        """The likeliest token (...,)."""
        return self._tokens(self.scores(z).argmax(-1))

    def logits(self, z: torch.Tensor) -> torch.Tensor:
        """Logits (..., V) over the whole vocabulary, -inf outside the draft vocabulary."""
        return self.model.draft_logits(z, None if self.linear is None else self.linear.weight)

    def children(self, ctx: Context, z: torch.Tensor, width: int, *, chances: bool,
                 ranked: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The drafts that follow nodes of states z (B, T, d), for drafters that draft a level
        at a time: with `chances`, the top `width` and their probabilities (a dynamic tree);
        with `ranked`, the top `width` (a tree); else one per node (B, T, 1), the argmax when
        greedy, or a draw with the distribution it was drawn from (B, T, V)."""
        if chances:
            probs, kids = self.top_chances(z, width)
            return kids, probs
        if ranked:
            return self.top(z, width), None
        if ctx.sampling.greedy:
            return self.argmax(z)[..., None], None
        q = ctx.sampling.probs(self.logits(z))
        return multinomial(q, ctx.generator)[..., None], q


def chain_origins(code: int, n: int, device: torch.device) -> torch.Tensor:
    """The origins (n + 1,) of a chain of n drafts that all come from `code`, after the root."""
    origins = torch.full((n + 1,), code, dtype=torch.long, device=device)
    origins[0] = HEAD_1
    return origins


def tree_tensors(kept: dict, tree: Tree, m: int,
                 device: torch.device) -> tuple[TreeTensors, torch.Tensor]:
    """The tree with a lookup branch of m tokens and its nodes' origins, built once per shape and
    kept in `kept` (the 4096 latest shapes: dynamic trees come in many)."""
    key = (tree.paths, m)
    if key not in kept:
        if len(kept) >= 4096:
            kept.pop(next(iter(kept)))
        tt = TreeTensors.build(tree, device, chain=m)
        kept[key] = tt, tree_origins(tt, len(tree.paths))
    return kept[key]


def tree_origins(tt: TreeTensors, n_tree: int) -> torch.Tensor:
    """The origins (N + 1,) of a heads' tree: a node at depth d is head d + 1's (the root head
    1's); nodes from n_tree on are a lookup branch's."""
    origins = tt.depth + HEAD_1
    origins[n_tree:] = LOOKUP
    return origins


class Drafter:
    """Proposes nothing: every round verifies the pending token alone (plain decoding)."""

    max_drafts = 0
    """The most drafts per row a round can verify (a tree's depth)."""
    deferred = 0.0
    """Seconds of the last round spent on work deferred from earlier rounds (heads 2..h catching
    up on tokens committed without drafting): not the cost of the round's own choice."""
    layers: torch.nn.Module | None = None
    """The drafter's own layers, outside the model (a draft vocabulary's rows, `DraftVocab`),
    which decode on the machine's chosen paths with the model's (`decode_linears`)."""
    int8_linears: Sequence[nn.Linear | StackedLinear] = ()
    """The linear layers that only drafting runs, which `generate(draft_int8=True)` multiplies
    in 8-bit integers (`mtp.decoding.arithmetic.int8_products`)."""

    @property
    def slots_needed(self) -> int:
        """Cache slots a round writes past the committed ones."""
        return self.max_drafts + 1

    def start(self, ctx: Context, prompts: list[list[int]], trunk: Trunk,
              pending: torch.Tensor) -> None:
        """After the prefill: `trunk` holds the trunk output at every prompt position."""

    def propose(self, ctx: Context, pending: torch.Tensor, n: int) -> Proposal:
        """The round's tokens: the pending token (B,) and n drafts per row."""
        return Proposal(pending[:, None], 0)

    def advance(self, ctx: Context, v: Verified) -> None:
        """After acceptance, before the cache lengths advance past the committed tokens: take
        in the round's committed tokens (and draft the next round's tokens from them)."""

    def keep(self, idx: torch.Tensor) -> None:
        """Rows `idx` go on; the others left the batch."""


class ParallelHeads(Drafter):
    """Heads 2..h, each reading the trunk output, draft h - 1 tokens from the last committed
    position."""

    def __init__(self, model: MTPTransformer, heads: int) -> None:
        self.stacked = stacked_heads(model, heads)
        self.vocab = DraftVocab(model)
        self.layers = self.vocab.linear
        # Drafting's products: the stacked heads' and the draft vocabulary's rows (without one,
        # the unembedding is head 1's too, which verifies: it stays exact).
        blocks = self.stacked.stacked.modules() if self.stacked.stacked is not None else ()
        self.int8_linears = [m for m in (*blocks, self.layers)
                             if isinstance(m, nn.Linear | StackedLinear)]
        self.max_drafts = heads - 1
        self.drafts = self.q = None
        # node j of the chain is head j + 1's draft
        self.origins = torch.arange(HEAD_1, heads + 1, device=next(model.parameters()).device)
        # Trunk outputs (B, 1, d) and rotary tables of tokens committed by rounds that drafted
        # nothing, not yet run through the draft heads (see `advance`).
        self.backlog: list[Trunk] = []

    def _run(self, ctx: Context, trunk: Trunk, nodes: torch.Tensor | int,
             last: torch.Tensor) -> None:
        """Run the draft heads over the committed tokens of a forward and draft from their
        hidden states at `last` (B,), an index into them. The committed tokens are `nodes`
        (B, t), or with an int t the forward's first t tokens.

        Padded rows repeat their last node: the padding's keys land past the row's new length,
        where nothing reads them. Keys and values land at slots lengths + 0..t-1: call after
        any compaction, before the lengths advance.
        """
        h, (cos, sin) = trunk
        cache = ctx.cache
        if isinstance(nodes, int):
            t = nodes
            h, cos, sin = h[:, :t], cos[:, :, :t], sin[:, :, :t]
        else:
            t = nodes.shape[1]
            h = h.gather(1, nodes[..., None].expand(-1, -1, h.shape[-1]))  # (B, t, d)
            idx = nodes[:, None, :, None].expand(-1, 1, -1, cos.shape[-1])
            cos, sin = cos.gather(2, idx), sin.gather(2, idx)  # (B, 1, t, hd/2) each
        slots = cache.lengths[:, None] + torch.arange(t, device=h.device)
        out = self.stacked(h, (cos, sin), cache, slots, chain_mask(cache.lengths, t))
        hidden = out[:, torch.arange(len(last), device=h.device), last]  # (h-1, B, d)
        self._draft(ctx, hidden.transpose(0, 1))
        ctx.timer.lap("draft")

    def _draft(self, ctx: Context, z: torch.Tensor) -> None:
        """One draft per head (B, h-1) from their normalised states z (B, h-1, d): the argmax
        when greedy, else a draw from the head's filtered distribution q (B, h-1, V), which the
        acceptance rule needs."""
        if ctx.sampling.greedy:
            self.drafts = self.vocab.argmax(z)
        else:
            self.q = ctx.sampling.probs(self.vocab.logits(z))
            self.drafts = multinomial(self.q, ctx.generator)

    def start(self, ctx, prompts, trunk, pending) -> None:
        lengths = torch.tensor([len(p) for p in prompts], device=pending.device)
        ctx.cache.truncate(torch.zeros_like(lengths))
        self._run(ctx, trunk, trunk[0].shape[1], lengths - 1)
        ctx.cache.truncate(lengths)

    def _catch_up_for(self, ctx: Context, n: int) -> None:
        """Before a round with n drafts: drafts must come from the last committed token."""
        if n and self.backlog:
            self._catch_up(ctx)

    def _catch_up(self, ctx: Context) -> None:
        """Run the draft heads over the backlog, the last m committed tokens."""
        start = ctx.timer.lap()
        m = len(self.backlog)
        h = torch.cat([t[0] for t in self.backlog], dim=1)  # (B, m, d)
        rope = tuple(torch.cat([t[1][i] for t in self.backlog], dim=2) for i in range(2))
        self.backlog = []
        lengths = ctx.cache.lengths
        ctx.cache.truncate(lengths - m)
        self._run(ctx, (h, rope), m, torch.full_like(lengths, m - 1))
        ctx.cache.truncate(lengths)
        self.deferred += ctx.timer.last - start

    def propose(self, ctx, pending, n) -> Proposal:
        self._catch_up_for(ctx, n)
        tokens = torch.cat([pending[:, None], self.drafts[:, :n]], dim=1)
        ctx.timer.lap("draft")
        return Proposal(tokens, n, q=None if self.q is None else self.q[:, :n],
                        origins=self.origins)

    def advance(self, ctx, v) -> None:
        if v.proposal.n == 0:
            # A round that drafted nothing committed one token per row. Heads 2..h wait until a
            # round wants drafts: where speculation does not pay (`policy.Adaptive`), they stop
            # costing anything.
            h, (cos, sin) = v.trunk
            self.backlog.append((h[:, :1], (cos[:, :, :1], sin[:, :, :1])))
            return
        # A chain's committed tokens are the first ones of the round.
        nodes = v.path.shape[1] if v.proposal.tree is None else v.path
        self._run(ctx, v.trunk, nodes, v.accepted)

    def keep(self, idx) -> None:
        if self.drafts is not None:
            self.drafts = self.drafts[idx]
        if self.q is not None:
            self.q = self.q[idx]
        self.backlog = [(h[idx], (cos[idx], sin[idx])) for h, (cos, sin) in self.backlog]


class ParallelHeadsTree(ParallelHeads):
    """The top-k candidates of heads 2..h form a tree, verified in one forward with a tree mask
    (each node sees its ancestors) and positions lengths + depth; the cache keeps the accepted
    path only.

    With `lookup` (`mtp.decoding.lookup.Lookup`), the prompt lookup's continuation is one more
    branch from the root: the round keeps the longer of the two the target agrees with.
    """

    def __init__(self, model: MTPTransformer, heads: int, tree: Tree, lookup=None) -> None:
        super().__init__(model, heads)
        self.tree = tree.pruned(heads - 1)
        self.top = max(self.tree.widths(), default=1)
        self.lookup = lookup
        extra = lookup.tokens if lookup is not None else 0
        self.max_drafts = max(self.tree.depth, extra)
        # Trees (the tree cut to fewer levels near the end, or each round's own) with a lookup
        # branch of some length, and their nodes' origins.
        self.by_shape: dict[tuple[tuple, int], tuple[TreeTensors, torch.Tensor]] = {}

    @property
    def slots_needed(self) -> int:
        return len(self.tree.paths) + (self.lookup.tokens if self.lookup is not None else 0)

    def start(self, ctx, prompts, trunk, pending) -> None:
        super().start(ctx, prompts, trunk, pending)
        if self.lookup is not None:
            self.lookup.start(prompts)

    def _draft(self, ctx, z) -> None:
        self.drafts = self.vocab.top(z, self.top)  # (B, h-1, top)

    def _round_tree(self, ctx: Context, n: int, branch: list[list[int]]) -> tuple[Tree, int]:
        """The tree of a round with at most n levels, and how many tokens of the lookup
        continuations `branch` (one per row) to verify beside it: all of them."""
        return self.tree.pruned(n), max(map(len, branch), default=0)

    def propose(self, ctx, pending, n) -> Proposal:
        self._catch_up_for(ctx, n)
        branch = self.lookup.continuations(ctx, n) if self.lookup is not None else []
        tree, m = self._round_tree(ctx, n, branch)
        tt, origins = tree_tensors(self.by_shape, tree, m, pending.device)
        # Node j holds candidate rank[j] of head depth[j] + 1; the root holds pending.
        n_tree = self.n_tree = len(tree.paths)
        tokens = self.drafts[:, (tt.depth[:n_tree] - 1).clamp(min=0), tt.rank[:n_tree]]
        tokens[:, 0] = pending  # (B, N+1)
        if m:
            tokens = torch.cat([tokens, self.lookup.pad(branch, pending.device, m)], dim=1)
        ctx.timer.lap("tree")
        return Proposal(tokens, max(tree.depth, m), tree=tt, origins=origins)


class ParallelHeadsDynamicTree(ParallelHeadsTree):
    """Heads 2..h draft a tree grown each round where they are sure (`DynamicTree`): their `top`
    candidates with their probabilities, the paths of largest chance added until a node more
    costs more forward time than its chance of being accepted is worth, by the verify forward's
    time measured on this machine (`mtp.decoding.cost.verify_seconds`)."""

    def __init__(self, model: MTPTransformer, heads: int, dynamic: DynamicTree,
                 lookup=None) -> None:
        # the static tree's attributes: a chain of the heads' depth, their top candidates
        super().__init__(model, heads, Tree.from_widths([1] * (heads - 1)), lookup)
        self.top = min(dynamic.top, model.cfg.draft_vocab or model.cfg.vocab_size)
        self.dynamic = dynamic
        self.max_nodes = dynamic.max_nodes
        self.chances: torch.Tensor | None = None  # (h-1, top): the round's candidates' chances
        self.seconds: list[float] = []

    @property
    def slots_needed(self) -> int:
        return self.max_nodes + 1 + (self.lookup.tokens if self.lookup is not None else 0)

    def start(self, ctx, prompts, trunk, pending) -> None:
        from mtp.decoding.cost import verify_seconds

        self.seconds = verify_seconds(ctx.model, len(prompts), self.slots_needed)
        if self.lookup is not None:  # its branch sized by its worth, like the tree
            self.worth = self.lookup.worth(ctx.stats.lookup_worth,
                                           by_kind=not self.dynamic.pooled_branch)
        super().start(ctx, prompts, trunk, pending)

    def _draft(self, ctx, z) -> None:
        probs, self.drafts = self.vocab.top_chances(z, self.top)  # (B, h-1, top)
        self.chances = probs.mean(0)  # one tree for the batch: the rows' chances averaged

    def _round_tree(self, ctx: Context, n: int, branch: list[list[int]]) -> tuple[Tree, int]:
        if n == 0:
            return Tree.from_paths([]), 0
        gains = self.worth.gains(branch, self.drafts[:, 0, 0].tolist()) \
            if self.lookup is not None else ()
        return self.dynamic.grow(self.chances[:n], self.seconds, gains)

    def advance(self, ctx, v) -> None:
        if self.lookup is not None and v.proposal.n:
            self.worth.observe(ctx, v, self.n_tree)
        super().advance(ctx, v)


class DraftModel(Drafter):
    """A separate model proposes up to gamma tokens, one forward each.

    Its cache holds every committed token but the last u + 1: the `unfed` ones (B, u), which the
    next round feeds it first, and the pending token. After a round that drafted, u = 1: the
    token before the verifier's one, which covers d_gamma when all drafts were accepted (the
    draft model never ran on it); rewriting it when it is already cached is harmless (same
    keys). A round that drafted nothing adds its token to the unfed ones.
    """

    def __init__(self, draft_model: MTPTransformer, gamma: int) -> None:
        self.model, self.max_drafts = draft_model, gamma
        self.origins = chain_origins(DRAFT_MODEL, gamma, next(draft_model.parameters()).device)

    def start(self, ctx, prompts, trunk, pending) -> None:
        self.cache = new_cache(self.model, len(prompts), ctx.cache.max_len)
        if max(len(p) for p in prompts) > 1:
            prefill(self.model, self.cache, [p[:-1] or p for p in prompts])
            ctx.stats.draft_forwards += 1
        self.cache.truncate(ctx.cache.lengths - 1)
        self.unfed = torch.tensor([[p[-1]] for p in prompts], device=pending.device)
        ctx.timer.lap("draft")

    def propose(self, ctx, pending, n) -> Proposal:
        drafts, qs = [], []
        inp = torch.cat([self.unfed, pending[:, None]], dim=1)
        for _ in range(n):
            cache = self.cache
            t = inp.shape[1]
            pos = cache.lengths[:, None] + torch.arange(t, device=inp.device)
            hidden, _ = forward(self.model, cache, inp, pos, chain_mask(cache.lengths, t))
            ctx.stats.draft_forwards += 1
            cache.truncate(cache.lengths + t)
            logits = self.model.unembed(hidden[:, -1])  # (B, V)
            if ctx.sampling.greedy:
                drafts.append(logits.argmax(-1))
            else:
                qs.append(ctx.sampling.probs(logits))
                drafts.append(multinomial(qs[-1], ctx.generator))
            inp = drafts[-1][:, None]
        tokens = torch.stack([pending, *drafts], dim=1)  # (B, n+1)
        ctx.timer.lap("draft")
        return Proposal(tokens, n, q=torch.stack(qs, 1) if qs else None, origins=self.origins)

    def advance(self, ctx, v) -> None:
        if v.proposal.n == 0:
            self.unfed = torch.cat([self.unfed, v.proposal.tokens], dim=1)
            return
        a = v.accepted
        # The token before the verifier's: the last committed one the target cache will hold.
        self.unfed = v.proposal.tokens[torch.arange(len(a), device=a.device), a][:, None]
        self.cache.truncate(ctx.cache.lengths + a)

    def keep(self, idx) -> None:
        self.cache.keep(idx)
        self.unfed = self.unfed[idx]


class Oracle(Drafter):
    """Drafts the tokens a reference decode emits (run greedy first): the engine's cost with
    drafts that are always right, an upper bound independent of head quality."""

    def __init__(self, reference: Sequence[Sequence[int]], n: int) -> None:
        self.reference, self.max_drafts = [list(r) for r in reference], n

    def start(self, ctx, prompts, trunk, pending) -> None:
        self.origins = chain_origins(ORACLE, self.max_drafts, pending.device)

    def propose(self, ctx, pending, n) -> Proposal:
        out = ctx.stopper.out
        rows = []
        for r in ctx.rows:
            done = len(out[r])  # the pending token is out[r][-1]
            rows.append((self.reference[r][done : done + n] + [0] * n)[:n])
        drafts = torch.tensor(rows, dtype=torch.long, device=pending.device).view(len(rows), n)
        ctx.timer.lap("draft")
        return Proposal(torch.cat([pending[:, None], drafts], dim=1), n, origins=self.origins)
