"""Candidate trees: their shape, the index tensors that verify one, and choosing one from the
heads' measured accuracies (Medusa's construction, a tree fixed for a whole call) or, each round,
from the heads' own confidence (EAGLE-2's dynamic trees, `DynamicTree`)."""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from mtp.model.transformer import MTPTransformer

__all__ = ["MAX_TREE_NODES", "DynamicTree", "Expansion", "Tree", "TreeTensors", "best_first",
           "head_accuracy", "place_children"]

#: The most nodes a tree may have: one forward verifies them all (Medusa's trees have ~64).
MAX_TREE_NODES = 4096


@dataclass(frozen=True)
class Tree:
    """A candidate tree: each node is a path of ranks, e.g. (0, 1) = head 2's top-1 token followed
    by head 3's second-best token. Node 0 is the root (the pending token); nodes are sorted by
    depth, so parents come before children.

    A node at depth d (1-based) holds the rank-r candidate of head d + 1, all heads drafting from
    the same position, so sibling tokens are distinct and the tree is a pruned Cartesian product.
    """

    paths: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if not self.paths or self.paths[0] != ():
            raise ValueError("a tree's first path must be the root ()")
        seen = set()
        for p in self.paths:
            if p in seen:
                raise ValueError(f"tree path {p} appears twice")
            if p and p[:-1] not in seen:
                raise ValueError(f"tree path {p} has no parent {p[:-1]} before it")
            if any(r < 0 for r in p):
                raise ValueError(f"tree path {p} has a negative rank")
            seen.add(p)

    @classmethod
    def from_paths(cls, paths: Sequence[Sequence[int]]) -> Tree:
        """A tree from its non-root paths in any order (the root is added)."""
        unique = sorted({tuple(p) for p in paths if len(p)}, key=lambda p: (len(p), p))
        return cls(((), *unique))

    @classmethod
    def from_widths(cls, widths: Sequence[int]) -> Tree:
        """The full tree with widths[d] children per node at depth d + 1 (Cartesian product)."""
        if any(w < 1 for w in widths):
            raise ValueError(f"tree widths must be >= 1 (got {list(widths)})")
        nodes, level_size = 0, 1
        for w in widths:  # counted before anything is built
            level_size *= w
            nodes += level_size
            if nodes > MAX_TREE_NODES:
                total = sum(math.prod(widths[:d + 1]) for d in range(len(widths)))
                raise ValueError(f"the tree {','.join(map(str, widths))} has {total} nodes; one "
                                 f"forward verifies at most {MAX_TREE_NODES}")
        level, paths = [()], []
        for w in widths:
            level = [p + (r,) for p in level for r in range(w)]
            paths += level
        return cls.from_paths(paths)

    @classmethod
    def from_accuracies(cls, accuracy: torch.Tensor, n_nodes: int) -> Tree:
        """The n_nodes-node tree of largest expected accepted length (Medusa's construction).

        A path's chance of being accepted is taken as the product of its ranks' accuracies,
        accuracy[d, r] = P(rank-r token of head d + 2 is the right one). Nodes are added best
        first; a child is never likelier than its parent, so the result is prefix-closed.
        """
        return cls.from_paths([path for _, path in best_first(accuracy, n_nodes)])

    @property
    def depth(self) -> int:
        return max(len(p) for p in self.paths)

    def widths(self) -> list[int]:
        """Top-k needed from each head: 1 + the largest rank used at each depth."""
        return [1 + max(p[d] for p in self.paths if len(p) > d) for d in range(self.depth)]

    def pruned(self, max_depth: int) -> Tree:
        return Tree(tuple(p for p in self.paths if len(p) <= max_depth))

    def __str__(self) -> str:
        return f"{len(self.paths) - 1} nodes, depth {self.depth}, widths {self.widths()}"


def best_first(accuracy: torch.Tensor, n_nodes: int) -> list[tuple[float, tuple[int, ...]]]:
    """The n_nodes likeliest paths of ranks and their chances, likeliest first, where a path's
    chance is the product of accuracy[d, r] over its ranks (accuracy (D, R): the chance that
    the rank-r candidate at depth d + 1 is right). A child is never likelier than its parent,
    so every prefix of the list is a tree."""
    acc = accuracy.double().clamp(0, 1).tolist()
    heap = [(-acc[0][r], (r,)) for r in range(len(acc[0]))] if acc else []
    heapq.heapify(heap)
    out = []
    while heap and len(out) < n_nodes:
        neg, path = heapq.heappop(heap)
        out.append((-neg, path))
        if len(path) < len(acc):
            for r, a in enumerate(acc[len(path)]):
                heapq.heappush(heap, (neg * a, path + (r,)))
    return out


@dataclass(frozen=True)
class Expansion:
    """The nodes one level of `DynamicTree.grow_by_levels` expands: their expansion indices idx
    (n,) (the root is 0), their parents' and their tokens (B, n); `ancestors` (M, M) and
    `level_of` (M,) cover every node the round may expand (ancestors[e, i]: i is e or an
    ancestor of e)."""

    level: int
    idx: torch.Tensor
    parents: list[int]
    tokens: torch.Tensor
    ancestors: torch.Tensor
    level_of: torch.Tensor


@dataclass(frozen=True)
class DynamicTree:
    """A tree grown anew each round where the heads are sure (EAGLE-2's dynamic trees).

    Each round takes the `top` candidates of every drafting head with their probabilities, adds
    paths best first (a path's chance is the product of its tokens' probabilities,
    `best_first`) and stops at the node count n that maximises expected tokens per second:
    (1 + the sum of the n chances, the expected accepted drafts) over the measured time of a
    forward over the round's tokens (`mtp.decoding.cost`), at most `max_nodes`. The tree is the
    same for every row of a batch: their chances are averaged.
    """

    max_nodes: int = 32
    """The most nodes a round's tree may have."""
    top: int = 8
    """Candidates of each head a round may use."""
    whole_branch: bool = False
    """Verify a branch beside the tree (prompt lookup's) whole every round, instead of the
    tokens worth their forward time (`choose`): the ablation of that choice."""
    pooled_branch: bool = False
    """Learn what the branch's tokens add over all its rounds alike, instead of per kind of
    match (`mtp.decoding.lookup.LookupWorth`): the ablation of that."""

    def __post_init__(self) -> None:
        if not 1 <= self.max_nodes <= MAX_TREE_NODES or self.top < 1:
            raise ValueError(f"a dynamic tree needs 1 <= max_nodes <= {MAX_TREE_NODES} and "
                             f"top >= 1 (got {self.max_nodes}, {self.top})")

    def grow(self, chances: torch.Tensor, seconds: Sequence[float],
             branch: Sequence[float] = ()) -> tuple[Tree, int]:
        """The round's tree from the heads' candidate probabilities `chances` (D, top), and
        how many tokens of a branch beside it to verify (`choose`): `seconds[t]` is the verify
        forward's time over the root and t more tokens."""
        paths = best_first(chances, min(self.max_nodes, len(seconds) - 1))
        n, m = self.choose([chance for chance, _ in paths], seconds, branch)
        return Tree.from_paths([path for _, path in paths[:n]]), m

    def grow_by_levels(self, top: int, levels: int, pending: torch.Tensor,
                       first: tuple[torch.Tensor, torch.Tensor],
                       expand: Callable[[Expansion], tuple[torch.Tensor, torch.Tensor]],
                       seconds: Sequence[float],
                       branch: Sequence[float] = ()) -> tuple[torch.Tensor, Tree, int]:
        """EAGLE-2's round for drafters that draft each level from the one before (eagle's
        layer, DeepSeek's modules): each level expands its `top` likeliest nodes (`expand` runs
        the drafter on them and returns their candidates and probabilities, each (B, n, top)),
        then the round keeps the likeliest nodes seen, as many as `choose` finds worth
        `seconds`, with as many tokens of a branch beside it as are worth theirs (`choose`).
        `first` holds the root's candidates (B, 1, top). Returns the kept tree's tokens
        (B, N + 1), `pending` first, the tree and the branch's length. One tree for the batch:
        the rows' chances are averaged."""
        dev = pending.device
        most = 1 + top * max(levels - 1, 0)  # the root and every node expanded
        anc = torch.eye(most, dtype=torch.bool, device=dev)  # among expanded nodes
        level_of = torch.zeros(most, dtype=torch.long, device=dev)
        # the candidates seen, level by level: their paths of ranks, tokens (B, n) and chances
        # (the rows' mean), each level's as one tensor: a round costs a few ops per level
        kids, probs = first
        paths = [(r,) for r in range(top)]  # the frontier: the level's candidates
        tokens, chance = kids[:, 0], probs[:, 0]  # (B, n) each
        parent = [0] * top  # each candidate's parent's expansion index
        seen_paths: list[tuple[int, ...]] = []
        seen_tokens, seen_chances = [], []
        expanded = 1
        for level in range(1, levels + 1):
            mean = chance.mean(0).tolist()
            seen_paths += paths
            seen_tokens.append(tokens)
            seen_chances += mean
            if level == levels:
                break
            pick = sorted(range(len(paths)), key=lambda i: -mean[i])[:top]
            idx = torch.arange(expanded, expanded + len(pick), device=dev)
            expanded += len(pick)
            parents = [parent[i] for i in pick]
            anc[idx] |= anc[parents]  # the parents are of earlier levels
            level_of[idx] = level
            sel = torch.tensor(pick, device=dev)
            kids, probs = expand(Expansion(level, idx, parents, tokens[:, sel], anc, level_of))
            paths = [paths[i] + (r,) for i in pick for r in range(top)]
            tokens = kids.flatten(1)  # (B, picked * top), each picked node's children in turn
            chance = (chance[:, sel, None] * probs).flatten(1)
            parent = [e for e in idx.tolist() for _ in range(top)]
        # the likeliest first; a child is never likelier than its parent, and ties go to the
        # shallower, so every prefix is a tree
        ranked = sorted(range(len(seen_paths)),
                        key=lambda j: (-seen_chances[j], len(seen_paths[j])))
        n, m = self.choose([seen_chances[j] for j in ranked], seconds, branch)
        tree = Tree.from_paths([seen_paths[j] for j in ranked[:n]])
        column = {p: j for j, p in enumerate(seen_paths)}
        every = torch.cat(seen_tokens, dim=1)  # (B, candidates seen)
        chosen = torch.tensor([column[p] for p in tree.paths[1:]], dtype=torch.long, device=dev)
        return torch.cat([pending[:, None], every[:, chosen]], dim=1), tree, m

    def choose(self, chances: Sequence[float], seconds: Sequence[float],
               branch: Sequence[float] = ()) -> tuple[int, int]:
        """How many of the nodes of `chances` (likeliest first, every prefix a tree) to verify,
        and how many tokens of a branch beside them whose i-th token adds `branch[i - 1]`
        accepted tokens in expectation (prompt lookup's, `mtp.decoding.lookup.LookupWorth`):
        the counts n <= `max_nodes` and m that maximise (1 + the n chances + the m gains) /
        seconds[n + m], seconds[t] being a forward's time over the root and t more tokens; with
        `whole_branch`, m is the whole branch (as much of it as `seconds` covers)."""
        whole = min(len(branch), len(seconds) - 1)
        best, n_best, m_best = 0.0, 0, 0
        for m in [whole] if self.whole_branch else range(whole + 1):
            gain = 1.0 + sum(branch[:m])
            if gain / seconds[m] > best:
                best, n_best, m_best = gain / seconds[m], 0, m
            most = min(self.max_nodes, len(seconds) - 1 - m)
            for n, chance in enumerate(chances[:most], start=1):
                gain += chance
                if gain / seconds[n + m] > best:
                    best, n_best, m_best = gain / seconds[n + m], n, m
        return n_best, m_best


@dataclass
class TreeTensors:
    """Index tensors of a tree for verification: N + 1 nodes, root first."""

    depth: torch.Tensor  # (N+1,) node depth, root 0
    rank: torch.Tensor  # (N+1,) rank of the node's token in its head's top-k (root: 0)
    parent: torch.Tensor  # (N+1,) parent node (root: 0)
    ancestors: torch.Tensor  # (N+1, N+1) bool: ancestors[j, i] = i is j or an ancestor of j
    path: torch.Tensor  # (N+1, D+1) nodes root..j, padded by repeating j

    @classmethod
    def build(cls, tree: Tree, device: torch.device, chain: int = 0) -> TreeTensors:
        """The tree's nodes, then `chain` more nodes in a chain below the root (a branch whose
        tokens come from elsewhere, such as prompt lookup; their rank is 0)."""
        index = {p: j for j, p in enumerate(tree.paths)}
        parent = [index[p[:-1]] if p else 0 for p in tree.paths]
        n_tree = len(parent)
        # The chain's first node hangs from the root, each later one from the node before.
        parent += ([0] + list(range(n_tree, n_tree + chain - 1))) if chain else []
        rank = [p[-1] if p else 0 for p in tree.paths] + [0] * chain
        n = len(parent)
        lineage = [[0]]  # node j's path from the root, j included (parents come first)
        for j in range(1, n):
            lineage.append(lineage[parent[j]] + [j])
        d = max(map(len, lineage)) - 1
        anc = [[False] * n for _ in range(n)]
        for row, nodes in zip(anc, lineage):
            for i in nodes:
                row[i] = True
        # built as lists, a tensor each: a dynamic tree builds one most rounds
        return cls(
            depth=torch.tensor([len(nodes) - 1 for nodes in lineage], device=device),
            rank=torch.tensor(rank, device=device),
            parent=torch.tensor(parent, device=device),
            ancestors=torch.tensor(anc, dtype=torch.bool, device=device),
            path=torch.tensor([nodes + [j] * (d + 1 - len(nodes))
                               for j, nodes in enumerate(lineage)], device=device),
        )


def place_children(tokens: torch.Tensor, kids: torch.Tensor, tt: TreeTensors,
                   level_of: list[int], members: list[int], level: int) -> None:
    """Write into `tokens` (B, N+1) the tokens of the nodes one level below `level`, from the
    candidates `kids` (B, len(members), width) of that level's nodes `members`: each child takes
    its parent's candidate of its own rank (a tree grown a level at a time)."""
    child = [c for c in range(len(level_of)) if level_of[c] == level + 1]
    if not child:
        return
    dev = tokens.device
    cidx = torch.tensor(child, device=dev)
    where = {m: i for i, m in enumerate(members)}
    parent_pos = torch.tensor([where[int(tt.parent[c])] for c in child], device=dev)
    tokens[:, cidx] = kids[:, parent_pos, tt.rank[cidx]]


@torch.no_grad()
def head_accuracy(
    model: MTPTransformer,
    sequences: Sequence[Sequence[int]],
    *,
    start: Sequence[int] | None = None,
    max_rank: int = 10,
) -> torch.Tensor:
    """How often each draft head ranks the true token at each rank, teacher-forced.

    Feed the model's own greedy continuations to get the accuracies greedy tree decoding sees.

    Args:
        sequences: token sequences (each within the context length).
        start: count only predictions of tokens at index >= start[i] (e.g. the prompt length).
        max_rank: ranks 0..max_rank-1 are counted.

    Returns:
        accuracy (K-1, max_rank): accuracy[d, r] = P(the rank-r token of head d + 2 is right).
    """
    k = model.cfg.n_future
    hits = torch.zeros(k - 1, max_rank, dtype=torch.float64)
    total = torch.zeros(k - 1, dtype=torch.float64)
    device = next(model.parameters()).device
    for i, seq in enumerate(sequences):
        x = torch.tensor(seq, device=device)[None]
        logits = model(x)[:, 0]  # (K, T, V)
        first = start[i] if start is not None else 1
        for d in range(1, k):  # head d + 1 at position t predicts token t + d + 1
            t = torch.arange(max(first - d - 1, 0), len(seq) - d - 1, device=device)
            if len(t) == 0:
                continue
            target = x[0, t + d + 1]
            lg = logits[d, t]
            rank = (lg > lg.gather(1, target[:, None])).sum(1)  # tokens scored above the truth
            hits[d - 1] += torch.bincount(rank[rank < max_rank].cpu(), minlength=max_rank)[
                :max_rank
            ].double()
            total[d - 1] += len(t)
    return (hits / total.clamp(min=1)[:, None]).float()
