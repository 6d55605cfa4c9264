"""Drafting with cascaded heads (`--model.head_type deepseek`): each head reads the one before
it, so each draft follows the drafts before it.

Head j + 1 (0-based depth j >= 1) at position q reads depth j - 1's output at q and token
q + j. Call that pair a cell (j, q). With L committed tokens in the trunk's cache and the
pending token at position L, the tokens 0..L are known. A cell is *final* when it reads only
known tokens (q + j <= L): it is computed once, teacher-forced like training, and its keys and
values stay in depth j's cache layer. The other cells read drafts.

A round with n drafts runs in two steps:

1. Catch up: each depth j <= n runs over its cells that became final since it last ran (slots
   and positions q, one forward per depth), so its cache holds every final cell.
2. Draft: the candidate tree (a chain is the tree of widths 1, 1, ...) is grown a level at a
   time. A node at level l holds token L + l. It owns the cells (j, L + l - j) for
   j = l + 1..n, the cells that read its token, and they read its parent's cells at depth
   j - 1. The cell (l + 1, L - 1) predicts the node's children: the top-k of its distribution
   for a tree, the argmax or a draw for a chain. Non-final cells attend to depth j's final
   cells and to the cells of the node's own ancestors, which sit in scratch slots past the
   final ones. Those scratch slots are overwritten by the next catch-up before anything
   reads them.

So every draft conditions on the drafts before it on its own path: a tree node is expanded
with the continuation of its own token, not with independent heads' guesses.

With a `DynamicTree` the tree is grown anew each round where the modules are sure (EAGLE-2):
each level expands the `top` likeliest nodes of the level before (a node's chance: the product
of its path's probabilities), computing their cells, and the round verifies the likeliest nodes
of all those it saw, as many as pay for their forward time on this machine
(`DynamicTree.choose`). An expanded node's cells take the scratch slot of its expansion index.
"""

from __future__ import annotations

import torch

from mtp.decoding.drafters import Drafter, DraftVocab, tree_origins, tree_tensors
from mtp.decoding.engine import Context, Proposal, Verified
from mtp.decoding.tree import DynamicTree, Expansion, Tree, TreeTensors, place_children
from mtp.model.transformer import MTPTransformer

__all__ = ["CascadedHeads"]


class CascadedHeads(Drafter):
    """Cascaded heads 2..heads draft a chain (tree=None), a tree of their own continuations, or
    such a tree grown each round (`DynamicTree`)."""

    def __init__(self, model: MTPTransformer, heads: int,
                 tree: Tree | DynamicTree | None = None) -> None:
        if model.head_layers[0] is not None:
            raise ValueError("cascaded drafting needs a head 1 that keeps no cache")
        self.model, self.depths = model, heads - 1
        self.dynamic = tree if isinstance(tree, DynamicTree) else None
        if self.dynamic is not None:  # each round grows its own tree, as deep as the chain
            self.tree = Tree.from_widths([1] * self.depths)
            self.top = min(self.dynamic.top, model.cfg.draft_vocab or model.cfg.vocab_size)
        else:
            self.tree = None if tree is None else tree.pruned(heads - 1)
            self.top = max(self.tree.widths(), default=1) if self.tree is not None else 1
        self.max_drafts = self.depths if self.tree is None else self.tree.depth
        # the tree (or chain) of a round with n drafts, and its nodes' origins: depth d, head d + 1
        self.by_depth: dict[int, tuple[TreeTensors, torch.Tensor]] = {}
        self.by_shape: dict = {}  # a dynamic round's tree -> `tree_tensors`
        self.vocab = DraftVocab(model)  # the draft vocabulary's rows, gathered once per decode
        self.layers = self.vocab.linear
        # Drafting's products: modules 2..h's and the draft vocabulary's rows (without one, the
        # unembedding is head 1's too, which verifies: it stays exact).
        self.int8_linears = [m for m in (*model.heads[1:heads].modules(), self.layers)
                             if isinstance(m, torch.nn.Linear)]

    @property
    def slots_needed(self) -> int:
        """Cache slots a round uses past the committed ones (verify and scratch alike)."""
        if self.dynamic is not None:  # the nodes verified, or those expanded on the way
            return max(self.dynamic.max_nodes, self.top * max(self.depths - 1, 0)) + 1
        return (self.max_drafts if self.tree is None else len(self.tree.paths) - 1) + 1

    # -- state -------------------------------------------------------------------------------
    def start(self, ctx, prompts, trunk, pending) -> None:
        if self.dynamic is not None:
            from mtp.decoding.cost import verify_seconds

            self.seconds = verify_seconds(ctx.model, len(prompts), self.dynamic.max_nodes + 1)
        h, rope = trunk
        b, s = len(prompts), ctx.cache.max_len
        d = h.shape[-1]
        # out[j][b, q]: depth j's output at position q (depth 0: head 1's, on the trunk output)
        self.out = h.new_zeros(self.depths + 1, b, s, d)
        self.out[0, :, : h.shape[1]] = self.model.head_output(0, h, rope)
        self.tokens = torch.zeros(b, s + 1, dtype=torch.long, device=h.device)
        for i, p in enumerate(prompts):
            self.tokens[i, : len(p)] = torch.tensor(p, device=h.device)
            self.tokens[i, len(p)] = pending[i]
        self.final = torch.zeros(self.depths + 1, b, dtype=torch.long, device=h.device)

    def keep(self, idx) -> None:
        self.out, self.tokens, self.final = self.out[:, idx], self.tokens[idx], self.final[:, idx]

    def advance(self, ctx: Context, v: Verified) -> None:
        """Record the committed tokens, the verifier's next token and head 1's output at each."""
        h, rope = v.trunk
        lengths = ctx.cache.lengths
        rows = torch.arange(len(lengths), device=h.device)[:, None]
        pos = lengths[:, None] + torch.arange(v.path.shape[1], device=h.device)  # (B, t)
        # Padding repeats the last committed node: it lands past the new length, unread.
        h_path = h.gather(1, v.path[..., None].expand(-1, -1, h.shape[-1]))
        idx = v.path[:, None, :, None].expand(-1, 1, -1, rope[0].shape[-1])
        rope_path = tuple(r.gather(2, idx) for r in rope)
        self.out[0][rows, pos] = self.model.head_output(0, h_path, rope_path)
        self.tokens[rows, pos] = v.proposal.tokens.gather(1, v.path)
        self.tokens[rows[:, 0], lengths + v.accepted + 1] = v.next_token

    # -- a round -----------------------------------------------------------------------------
    def propose(self, ctx, pending, n) -> Proposal:
        if n == 0:
            return Proposal(pending[:, None], 0)
        for j in range(1, n + 1):
            self._catch_up(ctx, j)
        ctx.timer.lap("draft")
        if self.dynamic is not None:
            tokens, tree = self._grow_dynamic(ctx, pending, n)
            tt, origins = tree_tensors(self.by_shape, tree, 0, pending.device)
            ctx.timer.lap("draft")
            return Proposal(tokens, tree.depth, tree=tt, origins=origins)
        if n not in self.by_depth:
            tree = Tree.from_widths([1] * n) if self.tree is None else self.tree.pruned(n)
            tt = TreeTensors.build(tree, pending.device)
            self.by_depth[n] = tt, tree_origins(tt, len(tree.paths))
        tt, origins = self.by_depth[n]
        tokens, q = self._grow(ctx, pending, tt, n)
        ctx.timer.lap("draft")
        if self.tree is None:  # the chain's nodes are in order: node j at depth j
            return Proposal(tokens, n, q=q, origins=origins)
        return Proposal(tokens, n, tree=tt, origins=origins)

    def _run(self, ctx: Context, j: int, x, tokens, positions, slots, mask) -> torch.Tensor:
        """Depth j over cells at `positions` (B, T): inputs x (B, T, d) and `tokens` (B, T);
        keys and values land at `slots` of its cache layer. Returns its outputs (B, T, d)."""
        rope = self.model.rotary(positions)
        return self.model.head_output(j, x, rope, tokens=tokens, cache=ctx.cache, slots=slots,
                                      mask=mask)

    def _catch_up(self, ctx: Context, j: int) -> None:
        """Depth j over its cells that became final since it last ran."""
        lengths = ctx.cache.lengths
        start, stop = self.final[j], lengths - j + 1  # final cells: q < stop
        m = int((stop - start).max())
        if m <= 0:
            return
        # Rows with fewer new cells repeat their last one (same inputs, same keys and values);
        # a row with none recomputes a cell it holds already, or a non-final one at q = 0.
        q = torch.minimum(start[:, None] + torch.arange(m, device=start.device),
                          (stop - 1)[:, None]).clamp(min=0)  # (B, m)
        rows = torch.arange(len(q), device=q.device)[:, None]
        mask = (torch.arange(int(q.max()) + 1, device=q.device) <= q[..., None])[:, None]
        out = self._run(ctx, j, self.out[j - 1][rows, q], self.tokens[rows, q + j], q, q, mask)
        self.out[j][rows, q] = out
        self.final[j] = torch.maximum(start, stop.clamp(min=0))

    def _children(self, ctx: Context, hidden: torch.Tensor, width: int):
        """Children of nodes with depth outputs `hidden` (B, T, d): their top-`width` tokens
        (B, T, width), and for a sampled chain the draws' distribution (B, T, V)."""
        return self.vocab.children(ctx, self.model.head_norm(hidden), width,
                                   chances=self.dynamic is not None,
                                   ranked=self.tree is not None)

    def _grow(self, ctx: Context, pending: torch.Tensor, tt: TreeTensors, n: int):
        """The tree's tokens (B, N+1), level by level, and for a sampled chain q (B, n, V)."""
        lengths = ctx.cache.lengths
        b, nodes = len(lengths), len(tt.depth)
        dev = pending.device
        rows = torch.arange(b, device=dev)[:, None]
        tokens = pending[:, None].repeat(1, nodes)  # every node's token, root = pending
        # out_at[j][:, m]: node m's cell at depth j. The root's cells (j, L - j) are final.
        out_at = {j: self.out[j][rows[:, 0], (lengths - j).clamp(min=0)][:, None].repeat(
            1, nodes, 1) for j in range(n + 1)}
        level_of = tt.depth.tolist()
        qs = []
        for level in range(n):
            members = [m for m in range(nodes) if level_of[m] == level]
            idx = torch.tensor(members, device=dev)
            if level:  # the level's own cells, at depths level + 1..n
                for j in range(level + 1, n + 1):
                    pos = (lengths - j + level)[:, None].expand(-1, len(members))
                    slots = self.final[j][:, None] + idx - 1  # scratch past the final cells
                    x = out_at[j - 1][:, tt.parent[idx]]
                    mask = self._scratch_mask(tt.depth, tt.ancestors, idx, j, lengths, nodes)
                    out_at[j][:, idx] = self._run(ctx, j, x, tokens[:, idx], pos.clamp(min=0),
                                                  slots, mask)
            width = self.top if self.tree is not None else 1
            kids, q = self._children(ctx, out_at[level + 1][:, idx], width)
            if q is not None:
                qs.append(q[:, 0])
            place_children(tokens, kids, tt, level_of, members, level)
        return tokens, (torch.stack(qs, 1) if qs else None)

    def _grow_dynamic(self, ctx: Context, pending: torch.Tensor,
                      levels: int) -> tuple[torch.Tensor, Tree]:
        """EAGLE-2's round on the modules (`DynamicTree.grow_by_levels`): a level's expanded
        nodes get their cells at every depth that reads their token, node e's in scratch slot
        final + e - 1."""
        lengths = ctx.cache.lengths
        rows = torch.arange(len(lengths), device=pending.device)
        # cells[e][j]: expanded node e's cell at depth j (B, d); the root's are final
        cells = [{j: self.out[j][rows, (lengths - j).clamp(min=0)] for j in range(levels + 1)}]

        def expand(x: Expansion) -> tuple[torch.Tensor, torch.Tensor]:
            new = [{} for _ in x.parents]
            for j in range(x.level + 1, levels + 1):  # the cells that read the level's tokens
                pos = (lengths - j + x.level)[:, None].expand(-1, len(x.parents))
                out = self._run(ctx, j, torch.stack([cells[p][j - 1] for p in x.parents], 1),
                                x.tokens, pos.clamp(min=0), self.final[j][:, None] + x.idx - 1,
                                self._scratch_mask(x.level_of, x.ancestors, x.idx, j, lengths,
                                                   len(x.ancestors)))
                for c, o in zip(new, out.unbind(1)):
                    c[j] = o
            cells.extend(new)
            return self._children(ctx, torch.stack([c[x.level + 1] for c in new], 1), self.top)

        tokens, tree, _ = self.dynamic.grow_by_levels(
            self.top, levels, pending, self._children(ctx, cells[0][1][:, None], self.top),
            expand, self.seconds)
        return tokens, tree

    def _scratch_mask(self, level_of: torch.Tensor, ancestors: torch.Tensor, idx: torch.Tensor,
                      j: int, lengths: torch.Tensor, nodes: int) -> torch.Tensor:
        """Attention mask (B, 1, T, S) of depth-j cells of nodes `idx`: depth j's final slots,
        and the scratch slots of the node's ancestors' (and its own) depth-j cells that exist
        (position >= 0). `level_of` (N,) and `ancestors` (N, N) describe the nodes
        (ancestors[m, i] = i is m or an ancestor of m)."""
        first = self.final[j]  # (B,) scratch slot of node m is first + m - 1
        s = int(first.max()) + nodes - 1
        slot = torch.arange(s, device=first.device)
        rel = slot[None] - first[:, None] + 1  # (B, S): the node whose scratch slot it is
        inside = (rel >= 1) & (rel < nodes)
        node = rel.clamp(1, nodes - 1)
        # a cell (j, L - j + level) exists only at positions >= 0
        exists = (lengths[:, None] - j + level_of[node]) >= 0  # (B, S)
        anc = ancestors[idx][:, node]  # (T, B, S)
        own = idx[:, None, None] == node[None]  # its own cell: never a row with nothing to see
        see = inside[None] & ((anc & exists[None]) | own)
        return ((rel < 1)[None] | see).transpose(0, 1)[:, None]
