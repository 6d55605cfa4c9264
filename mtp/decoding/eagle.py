"""Drafting with EAGLE's draft layer (`--model.head_type eagle`): one layer, run once per draft.

With L committed tokens and the pending token at position L, the layer's cache holds one *cell*
per position q < L: the first step at q, which reads the trunk output at q and token q + 1, all
known, so it is computed once (`advance`) and kept at slot q. The cell at q = L - 1 predicts the
first draft.

A round grows the candidate tree (a chain is the tree of widths 1, 1, ...) a level at a time.
A node at level l >= 1 holds token L + l; its cell, at position L + l - 1, reads its parent's
cell output (the root's: the cell at L - 1) and its own token, and predicts the node's children:
the top-k of its distribution for a tree, the argmax or a draw for a chain. It attends to every
committed cell and to the cells of its ancestors and itself, which sit in scratch slots past the
committed ones, overwritten by the next round's cells before anything reads them. That is what
`EagleLayer.unrolled` trains.

With a `DynamicTree` the tree is grown anew each round where the layer is sure (EAGLE-2): each
level expands the `top` likeliest nodes of the level before (a node's chance: the product of its
path's probabilities) into their `top` candidates, and the round verifies the likeliest nodes of
all those it saw, as many as pay for their forward time on this machine (`DynamicTree.choose`).

With `lookup` (`mtp.decoding.lookup.Lookup`), prompt lookup's continuation is one more branch
from the root, as for parallel heads (`ParallelHeadsTree`); beside a dynamic tree, as many of its
tokens as are worth their forward time (`mtp.decoding.lookup.LookupWorth`).
"""

from __future__ import annotations

import torch

from mtp.decoding.drafters import Drafter, DraftVocab, tree_tensors
from mtp.decoding.engine import Context, Proposal, chain_mask
from mtp.decoding.tree import DynamicTree, Expansion, Tree, TreeTensors, place_children
from mtp.model.transformer import MTPTransformer

__all__ = ["EagleHeads"]


class EagleHeads(Drafter):
    """EAGLE's layer drafts a chain (tree=None) of up to heads - 1 tokens, a tree, or a tree
    grown each round (`DynamicTree`)."""

    def __init__(self, model: MTPTransformer, heads: int,
                 tree: Tree | DynamicTree | None = None, lookup=None) -> None:
        if not model.unrolled:
            raise ValueError(f"EagleHeads drafts with --model.head_type eagle (got "
                             f"{model.cfg.head_type})")
        self.model, self.lookup = model, lookup
        self.dynamic = tree if isinstance(tree, DynamicTree) else None
        if self.dynamic is not None:  # each round grows its own tree, as deep as the chain
            self.tree = Tree.from_widths([1] * (heads - 1))
            self.top = min(self.dynamic.top, model.cfg.draft_vocab or model.cfg.vocab_size)
        else:
            self.tree = None if tree is None else tree.pruned(heads - 1)
            self.top = max(self.tree.widths(), default=1) if self.tree is not None else 1
        self.depth = heads - 1 if self.tree is None else self.tree.depth
        self.max_drafts = max(self.depth, lookup.tokens if lookup is not None else 0)
        self.by_shape: dict = {}  # a round's tree and lookup length -> `tree_tensors`
        self.vocab = DraftVocab(model)  # the draft vocabulary's rows, gathered once per decode
        self.layers = self.vocab.linear
        # Drafting's products, but `fuse`: it reads the trunk's blocks' outputs side by side, whose
        # few large channels would set one 8-bit scale for all, at a cost to the drafts.
        layer = model.heads[1]
        self.int8_linears = [m for m in (*layer.modules(), self.layers)
                             if isinstance(m, torch.nn.Linear) and m is not layer.fuse]
        self.root: torch.Tensor | None = None  # (B, d): the cell at L - 1 of each row

    @property
    def slots_needed(self) -> int:
        nodes = self.depth if self.tree is None else len(self.tree.paths) - 1
        if self.dynamic is not None:  # the nodes verified, or those expanded on the way
            nodes = max(self.dynamic.max_nodes, 1 + self.top * (self.depth - 1))
        return nodes + (self.lookup.tokens if self.lookup is not None else 0) + 1

    # -- state -------------------------------------------------------------------------------
    def _cells(self, ctx: Context, h, rope, tokens, last) -> None:
        """First steps over trunk outputs h (B, t, d) at slots lengths + 0..t-1 reading `tokens`
        (B, t); the root becomes each row's cell at index `last` (B,)."""
        lengths = ctx.cache.lengths
        t = h.shape[1]
        slots = lengths[:, None] + torch.arange(t, device=h.device)
        out = self.model.head_output(1, h, rope, tokens=tokens, cache=ctx.cache, slots=slots,
                                     mask=chain_mask(lengths, t))
        self.root = out[torch.arange(len(last), device=h.device), last]
        ctx.timer.lap("draft")

    def start(self, ctx, prompts, trunk, pending) -> None:
        if self.dynamic is not None:
            from mtp.decoding.cost import verify_seconds

            extra = self.lookup.tokens if self.lookup is not None else 0
            self.seconds = verify_seconds(ctx.model, len(prompts),
                                          self.dynamic.max_nodes + 1 + extra)
            if self.lookup is not None:  # its branch sized like the tree
                self.worth = self.lookup.worth(ctx.stats.lookup_worth,
                                               by_kind=not self.dynamic.pooled_branch)
        h, rope = trunk
        lengths = torch.tensor([len(p) for p in prompts], device=h.device)
        nxt = torch.zeros(h.shape[:2], dtype=torch.long, device=h.device)
        for b, p in enumerate(prompts):
            nxt[b, : len(p) - 1] = torch.tensor(p[1:], dtype=torch.long, device=h.device)
        nxt[torch.arange(len(prompts), device=h.device), lengths - 1] = pending
        ctx.cache.truncate(torch.zeros_like(lengths))
        self._cells(ctx, h, rope, nxt, lengths - 1)
        ctx.cache.truncate(lengths)
        if self.lookup is not None:
            self.lookup.start(prompts)

    def advance(self, ctx, v) -> None:
        """The first steps at the committed positions L..L + a, each reading the token after it
        (the last one the verifier's next token)."""
        h, rope = v.trunk
        h = h.gather(1, v.path[..., None].expand(-1, -1, h.shape[-1]))
        idx = v.path[:, None, :, None].expand(-1, 1, -1, rope[0].shape[-1])
        rope = tuple(r.gather(2, idx) for r in rope)
        committed = v.proposal.tokens.gather(1, v.path)  # (B, t), padded with the last
        rows = torch.arange(len(committed), device=h.device)
        nxt = torch.cat([committed[:, 1:], committed[:, -1:]], dim=1)
        nxt[rows, v.accepted] = v.next_token
        self._cells(ctx, h, rope, nxt, v.accepted)
        if self.dynamic is not None and self.lookup is not None and v.proposal.n:
            self.worth.observe(ctx, v, self.n_tree)

    def keep(self, idx) -> None:
        self.root = self.root[idx]

    # -- a round -----------------------------------------------------------------------------
    def propose(self, ctx, pending, n) -> Proposal:
        if n == 0:
            return Proposal(pending[:, None], 0)
        branch = self.lookup.continuations(ctx, n) if self.lookup is not None else []
        m = max(map(len, branch), default=0)
        levels = min(n, self.depth)
        q = None
        if self.dynamic is not None:
            tokens, tree, m = self._grow_dynamic(ctx, pending, levels, branch)
            tt, origins = tree_tensors(self.by_shape, tree, m, pending.device)
            self.n_tree = len(tree.paths)
        else:
            tree = Tree.from_widths([1] * levels) if self.tree is None else \
                self.tree.pruned(levels)
            tt, origins = tree_tensors(self.by_shape, tree, m, pending.device)
            tokens, q = self._grow(ctx, pending, tt, len(tree.paths), levels)
        if m:
            tokens = torch.cat([tokens, self.lookup.pad(branch, pending.device, m)], dim=1)
        ctx.timer.lap("draft")
        if self.tree is None and not m:  # the chain's nodes are in order: node j at depth j
            return Proposal(tokens, levels, q=q, origins=origins)
        return Proposal(tokens, max(tree.depth, m), tree=tt, origins=origins)

    def _children(self, ctx: Context, hidden: torch.Tensor, width: int):
        """Children of nodes with cell outputs `hidden` (B, T, d): their top-`width` tokens
        (B, T, width), and for a sampled chain the draws' distribution (B, T, V)."""
        return self.vocab.children(ctx, self.model.head_norm(hidden), width,
                                   chances=self.dynamic is not None,
                                   ranked=self.tree is not None or self.lookup is not None)

    def _grow(self, ctx: Context, pending: torch.Tensor, tt: TreeTensors, nodes: int, n: int):
        """The heads' tree's tokens (B, nodes), level by level, and for a sampled chain
        q (B, n, V)."""
        lengths = ctx.cache.lengths
        dev = pending.device
        tokens = pending[:, None].repeat(1, nodes)  # every node's token, root = pending
        out = self.root[:, None].repeat(1, nodes, 1)  # every node's cell output
        level_of = tt.depth[:nodes].tolist()
        qs = []
        for level in range(n):
            members = [j for j in range(nodes) if level_of[j] == level]
            idx = torch.tensor(members, device=dev)
            if level:
                pos = (lengths + level - 1)[:, None].expand(-1, len(members))
                slots = lengths[:, None] + idx - 1  # scratch past the committed cells
                rope = self.model.rotary(pos)
                out[:, idx] = self.model.head_output(
                    self._step(level), out[:, tt.parent[idx]], rope, tokens=tokens[:, idx],
                    cache=ctx.cache, slots=slots,
                    mask=self._mask(tt.ancestors, idx, lengths, nodes))
            kids, q = self._children(ctx, out[:, idx], self.top)
            if q is not None:
                qs.append(q[:, 0])
            place_children(tokens, kids, tt, level_of, members, level)
        return tokens, (torch.stack(qs, 1) if qs else None)

    def _grow_dynamic(self, ctx: Context, pending: torch.Tensor, levels: int,
                      branch: list[list[int]]) -> tuple[torch.Tensor, Tree, int]:
        """EAGLE-2's round (`DynamicTree.grow_by_levels`), with as many tokens of the lookup
        continuations `branch` as are worth theirs: the layer's cells of the nodes a level
        expands go to scratch slots, node e's at lengths + e - 1."""
        lengths = ctx.cache.lengths
        outs = [self.root]  # the expanded nodes' cell outputs, root first

        def expand(x: Expansion) -> tuple[torch.Tensor, torch.Tensor]:
            pos = (lengths + x.level - 1)[:, None].expand(-1, len(x.parents))
            out = self.model.head_output(
                self._step(x.level), torch.stack([outs[p] for p in x.parents], 1),
                self.model.rotary(pos), tokens=x.tokens, cache=ctx.cache,
                slots=lengths[:, None] + x.idx - 1,
                mask=self._mask(x.ancestors, x.idx, lengths, len(x.ancestors)))
            outs.extend(out.unbind(1))
            return self._children(ctx, out, self.top)

        first = self._children(ctx, self.root[:, None], self.top)
        gains = self.worth.gains(branch, first[0][:, 0, 0].tolist()) if branch else ()
        return self.dynamic.grow_by_levels(self.top, levels, pending, first, expand,
                                           self.seconds, gains)

    def _step(self, level: int) -> int:
        """The head (0-based) that drafts a node of `level` >= 1 from its parent: step level + 1
        of the chain, which is eagle's one layer at every step, also past the K - 1 steps it
        was trained unrolled over (`UNROLLED_MAX_HEADS`)."""
        return min(level + 1, self.model.cfg.n_future - 1)

    @staticmethod
    def _mask(ancestors: torch.Tensor, idx: torch.Tensor, lengths: torch.Tensor,
              nodes: int) -> torch.Tensor:
        """Attention mask (B, 1, T, S) of the cells of nodes `idx`: the committed cells, and the
        scratch slots (node j's at lengths + j - 1) of each node's ancestors and itself
        (`ancestors` (N, N): ancestors[j, i] = i is j or an ancestor of j)."""
        s = int(lengths.max()) + nodes - 1
        rel = torch.arange(s, device=lengths.device)[None] - lengths[:, None] + 1  # (B, S)
        node = rel.clamp(1, nodes - 1)
        see = (rel >= 1) & (rel < nodes)  # (B, S): a scratch slot of this round
        anc = ancestors[idx][:, node]  # (T, B, S)
        return ((rel < 1)[None] | (see[None] & anc)).transpose(0, 1)[:, None]
