"""Decoding: greedy and sampling baselines, self-speculation (linear, tree), draft-model spec.

Every decoder runs on the KV cache of `mtp.model` and is one function, `_decode_<name>`, over the
same helpers: `_prefill`, `_forward` (one cached forward with a mask built from a (T, T) template),
`_accept_linear` / `_accept_tree` (what a verify forward accepts) and `_Stopper` (max new tokens,
end-of-text, stop strings). `generate` validates the request and dispatches.

Batches. Rows keep their own positions: prompts of different lengths are right-padded for the
prefill only (the padding lands in cache slots past each row's length, which no mask ever opens),
and afterwards each row writes at its own slots `cache.lengths[b] + j`. Slot == RoPE position on the
committed path, so no row's positions are shifted by padding, and rows accept different numbers
of tokens per forward. Finished rows leave the batch, so the batch only pays for live rows.

Self-speculation runs heads 2..h as one batched block (`_DraftHeads`), and only on the tokens a
verify forward accepted (`_draft_pass`, after acceptance): their caches then only ever hold the
committed sequence, and a tree forward does not pay the draft heads for its rejected branches.

Invariant of every decoder between steps: the cache holds every committed token but the last one,
`pending`, which is the first input of the next forward (so a forward never recomputes a token).

Speculative sampling is exact with respect to the filtered target distribution p =
`probs_from_logits(head-1 logits, temperature, top_k, top_p)`, the distribution plain sampling
draws from:
- linear self-speculation and the draft model draw drafts from a proposal q (the filtered
  distribution of heads 2..K, or of the draft model) and accept each with min(1, p/q); on
  rejection they resample from norm(max(0, p - q)) (Leviathan et al. 2023, Chen et al. 2023);
- tree speculation proposes deterministic candidates (the top-k of each head). With point-mass
  proposals the optimal exact rule is: draw x ~ p at a node and move to the child whose token is
  x, if any. Sampling x at every node of the tree in parallel and walking from the root is then
  the same as drawing each token of the path from p in turn, so the output is exactly
  distributed as plain sampling.
Greedy is the temperature-0 case of the same rules (x = argmax p), so speculative greedy output is
plain greedy output token for token.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from mtp.model import KVCache, MTPTransformer

__all__ = [
    "DECODERS",
    "PHASES",
    "DecodeStats",
    "Sampling",
    "Tree",
    "generate",
    "head_accuracy",
    "load_completer",
    "probs_from_logits",
    "sample_from_logits",
]

DECODERS = ("greedy", "sample", "self-spec", "tree", "draft")
#: Phases of the time split: the prefill, drafting (heads 2..K or the draft model, and choosing the
#: drafts), tree building (tree tokens and positions), the verify forward (trunk + head 1 +
#: unembedding), acceptance and sampling, and cache update (masks, rollback, compaction).
PHASES = ("prefill", "draft", "tree", "verify", "accept", "cache")


# --------------------------------------------------------------------------------------------
# Sampling: one target distribution for every decoder


def probs_from_logits(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> torch.Tensor:
    """The sampling distribution: softmax(logits / temperature), cut to top-k, then to top-p.

    This is the target distribution p of plain sampling, and the one speculative sampling is
    exact with respect to. Ties at the k-th logit are all kept, so the result is deterministic.

    Args:
        logits: (..., V).
        temperature: > 0.
        top_k: keep the k most likely tokens (None: all).
        top_p: keep the smallest set of most likely tokens whose mass reaches top_p (None: all).

    Returns:
        fp32 probabilities (..., V) that sum to 1.
    """
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    p = logits.softmax(-1)
    if top_p is not None and top_p < 1.0:
        sorted_p, order = p.sort(dim=-1, descending=True)
        # Drop a token when the mass before it already reaches top_p; the first always stays.
        drop = sorted_p.cumsum(-1) - sorted_p >= top_p
        p = torch.zeros_like(p).scatter_(-1, order, sorted_p.masked_fill(drop, 0.0))
        p = p / p.sum(-1, keepdim=True)
    return p


def _multinomial(p: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw from each distribution of p (..., V): (...) token ids."""
    flat = p.reshape(-1, p.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(p.shape[:-1])


def sample_from_logits(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Draw a token from each row of logits (..., V); temperature 0 means argmax."""
    if temperature == 0:
        return logits.argmax(-1)
    return _multinomial(probs_from_logits(logits, temperature, top_k, top_p), generator)


@dataclass(frozen=True)
class Sampling:
    """How tokens are chosen: greedy (temperature 0) or sampling from the filtered softmax."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return probs_from_logits(logits, self.temperature, self.top_k, self.top_p)

    def choose(self, logits: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        return sample_from_logits(logits, self.temperature, self.top_k, self.top_p, generator)


# --------------------------------------------------------------------------------------------
# Statistics and timing


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
    draft_forwards: int = 0
    """Forward passes of the separate draft model (decoder `draft`)."""
    seconds: float = 0.0
    """Wall-clock time of the whole call."""
    time: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    """Seconds per phase (see `PHASES`); the rest of `seconds` is bookkeeping."""
    accepted: list[int] = field(default_factory=list)
    """accepted[n]: row-forwards that produced n tokens."""

    @property
    def tokens_per_forward(self) -> float:
        """L: new tokens per row-forward."""
        return self.tokens / max(self.row_forwards, 1)

    @property
    def ms_per_token(self) -> float:
        return 1000.0 * self.seconds / max(self.tokens, 1)

    def add(self, other: DecodeStats) -> None:
        """Accumulate another call's counts and times into this one."""
        self.tokens += other.tokens
        self.forwards += other.forwards
        self.row_forwards += other.row_forwards
        self.draft_forwards += other.draft_forwards
        self.seconds += other.seconds
        for k, v in other.time.items():
            self.time[k] = self.time.get(k, 0.0) + v
        n = max(len(self.accepted), len(other.accepted))
        self.accepted = [
            (self.accepted[i] if i < len(self.accepted) else 0)
            + (other.accepted[i] if i < len(other.accepted) else 0)
            for i in range(n)
        ]

    def _count(self, emitted: Sequence[int]) -> None:
        """Record one forward whose rows produced `emitted` tokens each."""
        self.forwards += 1
        self.row_forwards += len(emitted)
        for n in emitted:
            self.tokens += n
            self.accepted.extend([0] * (n + 1 - len(self.accepted)))
            self.accepted[n] += 1


class _Timer:
    """Adds wall-clock time to `stats.time[phase]`; synchronises CUDA so times are real."""

    def __init__(self, stats: DecodeStats, device: torch.device) -> None:
        self.stats, self.cuda = stats, device.type == "cuda"

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        if self.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        yield
        if self.cuda:
            torch.cuda.synchronize()
        self.stats.time[phase] += time.perf_counter() - t0


# --------------------------------------------------------------------------------------------
# Stop conditions


class _Stopper:
    """Collects each row's new tokens and applies max_new_tokens, end-of-text and stop strings.

    A row ends at the first token that completes a stop condition; that token is kept (the caller
    cuts the text at the stop string). Stop strings are searched in the new text only: a prompt
    ending in `def` must not stop on `\\ndef`.
    """

    def __init__(
        self,
        n_rows: int,
        max_new_tokens: int,
        eot_id: int | None,
        stop: Sequence[str],
        decode: Callable[[list[int]], str] | None,
        on_tokens: Callable[[int, list[int]], None] | None,
    ) -> None:
        self.out: list[list[int]] = [[] for _ in range(n_rows)]
        self.max_new, self.eot_id, self.stop, self.decode = max_new_tokens, eot_id, stop, decode
        self.on_tokens = on_tokens

    def remaining(self, row: int) -> int:
        return self.max_new - len(self.out[row])

    def extend(self, row: int, tokens: list[int]) -> tuple[int, bool]:
        """Append tokens to a row up to its first stop; returns (tokens kept, row finished)."""
        out, start = self.out[row], len(self.out[row])
        done = False
        for t in tokens:
            out.append(t)
            if t == self.eot_id or len(out) >= self.max_new:
                done = True
                break
        if self.stop and self._stop_in(out):
            # Find the first token whose text completes a stop string (earlier ones did not).
            k = next(k for k in range(start + 1, len(out) + 1) if self._stop_in(out[:k]))
            del out[k:]
            done = True
        if self.on_tokens is not None and len(out) > start:
            self.on_tokens(row, out[start:])
        return len(out) - start, done

    def _stop_in(self, tokens: list[int]) -> bool:
        text = self.decode(tokens)
        return any(s in text for s in self.stop)


# --------------------------------------------------------------------------------------------
# Trees


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
        acc = accuracy.double().clamp(0, 1).tolist()
        heap = [(-acc[0][r], (r,)) for r in range(len(acc[0]))]
        heapq.heapify(heap)
        paths = []
        while heap and len(paths) < n_nodes:
            neg, path = heapq.heappop(heap)
            paths.append(path)
            if len(path) < len(acc):
                for r, a in enumerate(acc[len(path)]):
                    heapq.heappush(heap, (neg * a, path + (r,)))
        return cls.from_paths(paths)

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


@dataclass
class _TreeTensors:
    """Index tensors of a tree for verification: N + 1 nodes, root first."""

    depth: torch.Tensor  # (N+1,) node depth, root 0
    rank: torch.Tensor  # (N+1,) rank of the node's token in its head's top-k (root: 0)
    parent: torch.Tensor  # (N+1,) parent node (root: 0)
    ancestors: torch.Tensor  # (N+1, N+1) bool: ancestors[j, i] = i is j or an ancestor of j
    path: torch.Tensor  # (N+1, D+1) nodes root..j, padded by repeating j
    levels: list[torch.Tensor]  # levels[d - 1]: the nodes at depth d

    @classmethod
    def build(cls, tree: Tree, device: torch.device) -> _TreeTensors:
        index = {p: j for j, p in enumerate(tree.paths)}
        n, d = len(tree.paths), tree.depth
        anc = torch.zeros(n, n, dtype=torch.bool)
        path = torch.zeros(n, d + 1, dtype=torch.long)
        for j, p in enumerate(tree.paths):
            nodes = [index[p[:i]] for i in range(len(p) + 1)]
            anc[j, nodes] = True
            path[j] = torch.tensor(nodes + [j] * (d + 1 - len(nodes)))
        return cls(
            depth=torch.tensor([len(p) for p in tree.paths], device=device),
            rank=torch.tensor([p[-1] if p else 0 for p in tree.paths], device=device),
            parent=torch.tensor([index[p[:-1]] if p else 0 for p in tree.paths], device=device),
            ancestors=anc.to(device),
            path=path.to(device),
            levels=[torch.tensor([j for j, p in enumerate(tree.paths) if len(p) == k],
                                 device=device) for k in range(1, d + 1)],
        )


# --------------------------------------------------------------------------------------------
# Cached forwards


def _mask(lengths: torch.Tensor, template: torch.Tensor) -> torch.Tensor:
    """Attention mask (B, 1, T, S') of T new tokens written at slots lengths[b] + 0..T-1.

    Every new token sees its row's committed slots (< lengths[b]); among the new tokens,
    template[i, j] (T, T) says whether token i sees token j (causal for a chain, ancestors for a
    tree). S' = max(lengths) + T: attention reads only the slots in use.
    """
    t = template.shape[0]
    s = int(lengths.max()) + t
    rel = torch.arange(s, device=lengths.device) - lengths[:, None]  # (B, S') slot - first new
    # Column t of the padded template is all False: slots past a row's new tokens stay closed.
    padded = torch.cat([template, template.new_zeros(t, 1)], dim=1)  # (T, T+1)
    inside = padded[:, rel.clamp(0, t)].transpose(0, 1)  # (B, T, S')
    return ((rel < 0)[:, None, :] | inside)[:, None]


def _causal(t: int, device: torch.device) -> torch.Tensor:
    return torch.ones(t, t, dtype=torch.bool, device=device).tril()


class _DraftHeads:
    """Heads 2..h run as one batched block: the same math as `model.head_hidden`, with each
    weight stacked over the heads, so every op runs once for all draft heads.

    Why: at small batch much of a block's cost is per-op overhead (CPU dispatch, GPU kernel
    launches), so h - 1 draft heads run one after the other cost about h - 1 blocks, which eats
    the speedup of speculation on a model with few trunk layers. Head 1, which decides the
    output, always runs through `model.head_hidden` itself, so the output is unaffected; the
    drafts may differ from the unbatched heads' in the last bits, which only changes what is
    proposed (and q is what was really sampled from, so sampling stays exact). A test checks
    this class against `model.head_hidden`, so a change to the model's block shows up there.

    NOTE: on the 2-core CPU, `cpu` config (d = 256, K = 4), 4 new tokens: heads 2..4 one by one
    3.2-4.1 ms per forward, batched 1.6-1.8 ms.
    """

    def __init__(self, model: MTPTransformer, n_heads: int) -> None:
        cfg = model.cfg
        self.model, self.n = model, n_heads - 1
        self.block = cfg.head_type == "block"
        heads = model.heads[1:n_heads]
        self.first_layer = cfg.n_trunk_layers + 1  # cache layer of head 2
        if self.n == 0:
            return
        if not self.block:  # linear heads: one d x d map each
            self.w = torch.stack([h.proj.weight.T for h in heads])  # (J, d, d)
            return
        self.n_heads, self.n_kv, self.hd = cfg.n_heads, cfg.kv_heads, cfg.head_dim

        def stack(get) -> torch.Tensor:
            return torch.stack([get(h) for h in heads])

        self.attn_norm = stack(lambda h: h.attn_norm.weight)[:, None, :]  # (J, 1, d)
        self.mlp_norm = stack(lambda h: h.mlp_norm.weight)[:, None, :]
        self.qkv = stack(lambda h: h.attn.qkv.weight.T)  # (J, d, (H + 2 Hkv) hd)
        self.proj = stack(lambda h: h.attn.proj.weight.T)  # (J, d, d)
        self.gate_up = stack(lambda h: h.mlp.gate_up.weight.T)  # (J, d, 2 f)
        self.down = stack(lambda h: h.mlp.down.weight.T)  # (J, f, d)
        self.eps = heads[0].attn_norm.eps

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xf = x.float()  # fp32 statistics, as `mtp.model.RMSNorm`
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * weight

    def __call__(
        self,
        h: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: KVCache,
        slots: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """Normalised hidden states of heads 2..h (J, B, T, d) for trunk output h (B, T, d)."""
        from mtp.model import apply_rope

        b, t, d = h.shape
        x = h.reshape(1, b * t, d)  # every head reads the same trunk output
        if not self.block:
            return self.model.norm(torch.matmul(x, self.w)).view(self.n, b, t, d)
        qkv = torch.matmul(self._norm(x, self.attn_norm), self.qkv)  # (J, BT, (H + 2Hkv) hd)
        qkv = qkv.view(self.n, b, t, -1, self.hd).transpose(2, 3)  # (J, B, H + 2Hkv, T, hd)
        q, k, v = qkv.split([self.n_heads, self.n_kv, self.n_kv], dim=2)
        cos, sin = rope  # (B, 1, T, hd/2): broadcasts over the heads' axis
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        layers = slice(self.first_layer, self.first_layer + self.n)
        k_cache, v_cache = cache.k[layers], cache.v[layers]  # (J, B, Hkv, S, hd)
        idx = slots[None, :, None, :, None].expand(self.n, -1, self.n_kv, -1, self.hd)
        k_cache.scatter_(3, idx, k.to(k_cache.dtype))
        v_cache.scatter_(3, idx, v.to(v_cache.dtype))
        s = mask.shape[-1]
        k, v = k_cache[:, :, :, :s].to(q.dtype), v_cache[:, :, :, :s].to(q.dtype)
        if self.n_kv != self.n_heads:
            rep = self.n_heads // self.n_kv
            k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out = out.transpose(2, 3).reshape(self.n, b * t, d)  # (J, BT, d)
        x = x + torch.matmul(out, self.proj)
        gate, up = torch.matmul(self._norm(x, self.mlp_norm), self.gate_up).chunk(2, dim=-1)
        x = x + torch.matmul(torch.nn.functional.silu(gate) * up, self.down)
        return self.model.norm(x).view(self.n, b, t, d)


def _forward(
    model: MTPTransformer,
    cache: KVCache,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    template: torch.Tensor,
    timer: _Timer,
    phase: str = "verify",
) -> tuple[torch.Tensor, tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]]:
    """Run tokens (B, T) through the trunk and head 1, writing their keys and values at slots
    lengths + 0..T-1 (lengths are not advanced: the caller decides what stays).

    Returns head 1's normalised hidden state (B, T, d), and the trunk output with its rotary
    tables, from which `_draft_pass` runs the draft heads on the tokens that were accepted.
    """
    with timer("cache"):
        slots = cache.lengths[:, None] + torch.arange(tokens.shape[1], device=tokens.device)
        mask = _mask(cache.lengths, template)
    with timer(phase):
        h, rope = model.trunk(tokens, positions=positions, cache=cache, slots=slots, mask=mask)
        return model.head_hidden(0, h, rope, cache=cache, slots=slots, mask=mask), (h, rope)


def _draft_pass(
    heads: _DraftHeads,
    cache: KVCache,
    trunk: tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]],
    nodes: torch.Tensor,
    last: torch.Tensor,
    timer: _Timer,
) -> torch.Tensor:
    """Run the draft heads over the newly committed tokens; their hidden states at the last one.

    The draft heads only ever see the committed sequence: they run after acceptance, on the
    trunk outputs of the accepted tokens, so a verify forward pays for draft heads on a+1 tokens
    instead of on every draft or tree node (most of a tree is rejected).

    Args:
        trunk: trunk output (B, T, d) and rotary tables of the verify forward.
        nodes: (B, t) which of the T tokens were committed, in order; padded rows repeat their
            last node (the padding's keys land past the row's new length, where nothing reads).
        last: (B,) index into `nodes` of each row's last committed token.

    Returns:
        (h-1, B, d). Keys and values land at slots lengths + 0..t-1: call after any compaction,
        before the lengths advance.
    """
    h, (cos, sin) = trunk
    with timer("draft"):
        t = nodes.shape[1]
        h = h.gather(1, nodes[..., None].expand(-1, -1, h.shape[-1]))  # (B, t, d)
        idx = nodes[:, None, :, None].expand(-1, 1, -1, cos.shape[-1])
        rope = cos.gather(2, idx), sin.gather(2, idx)  # (B, 1, t, hd/2) each
        slots = cache.lengths[:, None] + torch.arange(t, device=h.device)
        mask = _mask(cache.lengths, _causal(t, h.device))
        out = heads(h, rope, cache, slots, mask)  # (h-1, B, t, d)
        return out[:, torch.arange(len(last), device=h.device), last]


def _new_cache(model: MTPTransformer, batch: int, max_len: int) -> KVCache:
    p = next(model.parameters())
    return KVCache(model.cfg, batch, max_len, device=p.device, dtype=p.dtype)


def _prefill(
    model: MTPTransformer,
    cache: KVCache,
    prompts: list[list[int]],
    timer: _Timer,
    heads: _DraftHeads | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the (right-padded) prompts through the trunk, head 1 and the draft heads.

    Returns the hidden states at each row's last prompt token: head 1's (B, d) and the draft
    heads' (h-1, B, d) or None. Afterwards `cache.lengths` are the prompt lengths.
    """
    device = cache.k.device
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    t = int(lengths.max())
    tokens = torch.zeros(len(prompts), t, dtype=torch.long, device=device)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = torch.tensor(p, device=device)
    cache.truncate(torch.zeros_like(lengths))
    positions = torch.arange(t, device=device).expand(len(prompts), -1)
    hidden, trunk = _forward(model, cache, tokens, positions, _causal(t, device), timer,
                             phase="prefill")
    drafts = None
    if heads is not None and heads.n > 0:
        drafts = _draft_pass(heads, cache, trunk, positions, lengths - 1, timer)
    cache.truncate(lengths)
    return hidden[torch.arange(len(prompts), device=device), lengths - 1], drafts


def _keep_rows(cache: KVCache, keep: torch.Tensor) -> None:
    """Drop finished rows from a cache (keep: indices of the rows that go on)."""
    cache.k, cache.v = cache.k[:, keep], cache.v[:, keep]
    cache.lengths = cache.lengths[keep]


# --------------------------------------------------------------------------------------------
# Acceptance


def _accept_linear(
    logits: torch.Tensor,
    drafts: torch.Tensor,
    q: torch.Tensor | None,
    sampling: Sampling,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept the longest valid prefix of a chain of drafts, plus one token from the target.

    Args:
        logits: target logits (B, n+1, V) at [pending, d_1, ..., d_n]; row j predicts d_{j+1}.
        drafts: (B, n).
        q: proposal probabilities the drafts were drawn from (B, n, V); None when greedy.

    Returns:
        a (B,) accepted drafts per row, and the next token (B,): head 1's choice after d_a, or
        on a rejection the resample from norm(max(0, p - q)).
    """
    b, n = drafts.shape
    rows = torch.arange(b, device=drafts.device)
    if n == 0:
        return torch.zeros_like(rows), sampling.choose(logits[:, 0], generator)
    if sampling.greedy:
        choice = logits.argmax(-1)  # (B, n+1)
        a = (drafts == choice[:, :n]).long().cumprod(1).sum(1)
        return a, choice[rows, a]
    p = sampling.probs(logits)  # (B, n+1, V)
    p_d = p[:, :n].gather(-1, drafts[..., None])[..., 0]  # (B, n)
    q_d = q.gather(-1, drafts[..., None])[..., 0]
    u = torch.rand(b, n, device=drafts.device, generator=generator)
    a = (u * q_d < p_d).long().cumprod(1).sum(1)  # accept d_j with probability min(1, p/q)
    target = p[rows, a]  # (B, V)
    # Rows that rejected d_{a+1} draw from the residual; rows that accepted all draw from p.
    q_pad = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)  # (B, n+1, V)
    residual = (target - q_pad[rows, a]).clamp(min=0)
    mass = residual.sum(-1, keepdim=True)
    # mass is 0 only if p == q, where a rejection has probability 0; fall back to p anyway.
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), target)
    target = torch.where((a < n)[:, None], residual, target)
    return a, _multinomial(target, generator)


def _accept_tree(
    logits: torch.Tensor,
    node_tokens: torch.Tensor,
    tt: _TreeTensors,
    sampling: Sampling,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Walk the tree from the root, following the child whose token the target chose.

    Args:
        logits: target logits (B, N+1, V) at every node.
        node_tokens: (B, N+1), root first.

    Returns:
        The deepest accepted node (B,) and the next token (B,): the target's choice there.
    """
    choice = sampling.choose(logits, generator)  # (B, N+1): x ~ p (or argmax) at every node
    ok = node_tokens == choice[:, tt.parent]  # (B, N+1): the parent chose this node's token
    ok[:, 0] = True
    # Level by level from the root, ok[j] becomes: every token on j's path was chosen.
    for at in tt.levels:
        ok[:, at] &= ok[:, tt.parent[at]]
    # Siblings hold distinct tokens, so the accepted nodes form one chain: take its deepest.
    last = torch.where(ok, tt.depth + 1, 0).argmax(1)  # (B,)
    return last, choice[torch.arange(len(last), device=last.device), last]


# --------------------------------------------------------------------------------------------
# Decoders


@dataclass
class _Context:
    """What every decoder needs besides the model and the prompts."""

    sampling: Sampling
    stopper: _Stopper
    timer: _Timer
    stats: DecodeStats
    generator: torch.Generator | None
    window: int  # positions available: max_seq_len (of the target and draft model)


def _commit(
    ctx: _Context, rows: list[int], emitted: list[list[int]], lengths: torch.Tensor
) -> tuple[list[int], torch.Tensor | None]:
    """Hand each row's accepted tokens to the stopper and count the forward.

    `lengths` are the cache lengths after the update; a row whose sequence fills the context
    window (cache + pending token) also ends. Returns the rows still going and, if some
    finished, the batch indices to keep (else None).
    """
    kept, alive = [], []
    for i, (row, toks, n_cached) in enumerate(zip(rows, emitted, lengths.tolist(), strict=True)):
        n, done = ctx.stopper.extend(row, toks)
        kept.append(n)
        if not done and n_cached + 1 < ctx.window:
            alive.append(i)
    ctx.stats._count(kept)
    if len(alive) == len(rows):
        return rows, None
    return [rows[i] for i in alive], torch.tensor(alive, dtype=torch.long, device=lengths.device)


def _n_drafts(ctx: _Context, rows: list[int], lengths: torch.Tensor, most: int) -> int:
    """How many tokens to draft: at most `most`, no position past the context window, and no more
    than the longest row can still use (the verify forward adds one token of its own)."""
    room = ctx.window - 1 - int(lengths.max())  # the pending token sits at position lengths[b]
    need = max(ctx.stopper.remaining(r) for r in rows) - 1
    return max(0, min(most, room, need))


def _decode_plain(
    model: MTPTransformer, prompts: list[list[int]], ctx: _Context, max_len: int
) -> None:
    """Greedy or sampling baseline: one token per forward, trunk and head 1 only, KV cached."""
    device = next(model.parameters()).device
    cache = _new_cache(model, len(prompts), max_len)
    hid, _ = _prefill(model, cache, prompts, ctx.timer)
    with ctx.timer("accept"):
        pending = ctx.sampling.choose(model.unembed(hid), ctx.generator)  # (B,)
    rows, keep = _commit(ctx, list(range(len(prompts))), [[t] for t in pending.tolist()],
                         cache.lengths)
    one = _causal(1, device)
    while rows:
        if keep is not None:
            _keep_rows(cache, keep)
            pending = pending[keep]
        hid, _ = _forward(model, cache, pending[:, None], cache.lengths[:, None], one, ctx.timer)
        with ctx.timer("verify"):
            logits = model.unembed(hid[:, 0])  # (B, V)
        with ctx.timer("accept"):
            pending = ctx.sampling.choose(logits, ctx.generator)
        with ctx.timer("cache"):
            cache.truncate(cache.lengths + 1)
        rows, keep = _commit(ctx, rows, [[t] for t in pending.tolist()], cache.lengths)


def _draft_heads(
    model: MTPTransformer,
    hidden: torch.Tensor,
    ctx: _Context,
    top: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Drafts from heads 2..h, given their hidden states (h-1, B, d) at the last accepted
    position.

    With `top` (tree): the max(top) best tokens of each head (B, h-1, max(top)); q is None.
    Otherwise (linear): one draft per head (B, h-1), the argmax when greedy, else drawn from the
    head's filtered distribution q (B, h-1, V), which the acceptance test needs.
    """
    with ctx.timer("draft"):
        logits = model.unembed(hidden.transpose(0, 1))  # (B, h-1, V)
        if top is not None:
            return logits.topk(max(top), dim=-1).indices, None
        if ctx.sampling.greedy:
            return logits.argmax(-1), None
        q = ctx.sampling.probs(logits)
        return _multinomial(q, ctx.generator), q


def _decode_self_spec(
    model: MTPTransformer, prompts: list[list[int]], ctx: _Context, max_len: int, n_heads: int
) -> None:
    """Linear self-speculation (blockwise parallel decoding, Stern et al. 2018).

    Heads 2..h draft h - 1 tokens from the last accepted position; one forward over [pending,
    drafts] verifies them with head 1 and, at the last accepted position, drafts the next block.
    With h = 1 this is plain decoding through the speculative code path.
    """
    device = next(model.parameters()).device
    cache = _new_cache(model, len(prompts), max_len)
    heads = _DraftHeads(model, n_heads)
    hid, dhid = _prefill(model, cache, prompts, ctx.timer, heads)
    with ctx.timer("accept"):
        pending = ctx.sampling.choose(model.unembed(hid), ctx.generator)
    drafts, q = pending[:, None][:, :0], None  # (B, 0): one head drafts nothing
    if n_heads > 1:
        drafts, q = _draft_heads(model, dhid, ctx)
    rows, keep = _commit(ctx, list(range(len(prompts))), [[t] for t in pending.tolist()],
                         cache.lengths)
    while rows:
        if keep is not None:
            _keep_rows(cache, keep)
            pending, drafts = pending[keep], drafts[keep]
            q = None if q is None else q[keep]
        n = _n_drafts(ctx, rows, cache.lengths, n_heads - 1)
        d = drafts[:, :n]
        tokens = torch.cat([pending[:, None], d], dim=1)  # (B, n+1)
        positions = cache.lengths[:, None] + torch.arange(n + 1, device=device)
        hid, trunk = _forward(model, cache, tokens, positions, _causal(n + 1, device), ctx.timer)
        with ctx.timer("verify"):
            logits = model.unembed(hid)  # (B, n+1, V)
        with ctx.timer("accept"):
            a, nxt = _accept_linear(logits, d, None if q is None else q[:, :n], ctx.sampling,
                                    ctx.generator)
        if n_heads > 1:
            nodes = torch.arange(int(a.max()) + 1, device=device).expand(len(a), -1)
            dhid = _draft_pass(heads, cache, trunk, nodes, a, ctx.timer)
            drafts, q = _draft_heads(model, dhid, ctx)
        with ctx.timer("cache"):
            cache.truncate(cache.lengths + a + 1)  # the pending token and the accepted drafts
        emitted = [x[:k] + [t] for x, k, t in zip(d.tolist(), a.tolist(), nxt.tolist(),
                                                   strict=True)]
        pending = nxt
        rows, keep = _commit(ctx, rows, emitted, cache.lengths)


def _decode_tree(
    model: MTPTransformer,
    prompts: list[list[int]],
    ctx: _Context,
    max_len: int,
    n_heads: int,
    tree: Tree,
) -> None:
    """Tree self-speculation: the top-k of heads 2..h form a candidate tree (Medusa-style),
    verified in one forward with a tree mask (each node sees its ancestors) and positions
    lengths + depth. The accepted path is compacted into contiguous slots; the rest is dropped.
    """
    device = next(model.parameters()).device
    tree = tree.pruned(n_heads - 1)
    top = tree.widths()
    by_depth: dict[int, _TreeTensors] = {}  # the tree cut to fewer levels near the end
    cache = _new_cache(model, len(prompts), max_len)
    heads = _DraftHeads(model, n_heads)
    hid, dhid = _prefill(model, cache, prompts, ctx.timer, heads)
    with ctx.timer("accept"):
        pending = ctx.sampling.choose(model.unembed(hid), ctx.generator)
    cand, _ = _draft_heads(model, dhid, ctx, top)  # (B, h-1, max(top))
    rows, keep = _commit(ctx, list(range(len(prompts))), [[t] for t in pending.tolist()],
                         cache.lengths)
    while rows:
        if keep is not None:
            _keep_rows(cache, keep)
            pending, cand = pending[keep], cand[keep]
        with ctx.timer("tree"):
            depth = _n_drafts(ctx, rows, cache.lengths, tree.depth)
            if depth not in by_depth:
                by_depth[depth] = _TreeTensors.build(tree.pruned(depth), device)
            tt = by_depth[depth]
            # Node j holds candidate rank[j] of head depth[j] + 1; the root holds pending.
            node_tokens = cand[:, (tt.depth - 1).clamp(min=0), tt.rank]  # (B, N+1)
            node_tokens[:, 0] = pending
            positions = cache.lengths[:, None] + tt.depth  # a node's position is its depth
        hid, trunk = _forward(model, cache, node_tokens, positions, tt.ancestors, ctx.timer)
        with ctx.timer("verify"):
            logits = model.unembed(hid)  # (B, N+1, V)
        with ctx.timer("accept"):
            last, nxt = _accept_tree(logits, node_tokens, tt, ctx.sampling, ctx.generator)
        with ctx.timer("cache"):
            a = tt.depth[last]
            path = tt.path[last, : int(a.max()) + 1]  # (B, t): root .. last, padded with last
            # Padding copies land past the new length, where nothing reads them.
            cache.compact(cache.lengths[:, None] + path, cache.lengths)
        # After the compaction, which moves every layer's slots (draft heads' included).
        cand, _ = _draft_heads(model, _draft_pass(heads, cache, trunk, path, a, ctx.timer), ctx,
                               top)
        with ctx.timer("cache"):
            cache.truncate(cache.lengths + a + 1)
        toks = node_tokens.gather(1, path).tolist()
        emitted = [x[1 : k + 1] + [t] for x, k, t in zip(toks, a.tolist(), nxt.tolist(),
                                                          strict=True)]
        pending = nxt
        rows, keep = _commit(ctx, rows, emitted, cache.lengths)


def _decode_draft(
    model: MTPTransformer,
    draft_model: MTPTransformer,
    prompts: list[list[int]],
    ctx: _Context,
    max_len: int,
    gamma: int,
) -> None:
    """Speculative decoding with a separate draft model (Leviathan et al. 2023).

    The draft model proposes up to gamma tokens, one forward each; the target verifies them in
    one forward. The draft cache holds every committed token but the last two, and each round
    feeds it [previous, pending]: that covers d_gamma when all drafts were accepted (the draft
    model never ran on it), and rewriting the older of the two is harmless (same keys).
    """
    device = next(model.parameters()).device
    cache = _new_cache(model, len(prompts), max_len)
    dcache = _new_cache(draft_model, len(prompts), max_len)
    hid, _ = _prefill(model, cache, prompts, ctx.timer)
    if max(len(p) for p in prompts) > 1:
        _prefill(draft_model, dcache, [p[:-1] or p for p in prompts], ctx.timer)
        ctx.stats.draft_forwards += 1
    dcache.truncate(cache.lengths - 1)
    with ctx.timer("accept"):
        pending = ctx.sampling.choose(model.unembed(hid), ctx.generator)
    prev = torch.tensor([p[-1] for p in prompts], device=device)
    rows, keep = _commit(ctx, list(range(len(prompts))), [[t] for t in pending.tolist()],
                         cache.lengths)
    two, one = _causal(2, device), _causal(1, device)
    while rows:
        if keep is not None:
            _keep_rows(cache, keep)
            _keep_rows(dcache, keep)
            pending, prev = pending[keep], prev[keep]
        n = _n_drafts(ctx, rows, cache.lengths, gamma)
        drafts, qs = [], []
        inp, template = torch.stack([prev, pending], dim=1), two
        for _ in range(n):
            pos = dcache.lengths[:, None] + torch.arange(inp.shape[1], device=device)
            dh, _ = _forward(draft_model, dcache, inp, pos, template, ctx.timer, phase="draft")
            ctx.stats.draft_forwards += 1
            with ctx.timer("draft"):
                dcache.truncate(dcache.lengths + inp.shape[1])
                logits = draft_model.unembed(dh[:, -1])  # (B, V)
                if ctx.sampling.greedy:
                    drafts.append(logits.argmax(-1))
                else:
                    qs.append(ctx.sampling.probs(logits))
                    drafts.append(_multinomial(qs[-1], ctx.generator))
            inp, template = drafts[-1][:, None], one
        d = torch.stack(drafts, 1) if drafts else pending[:, None][:, :0]  # (B, n)
        q = torch.stack(qs, 1) if qs else None
        tokens = torch.cat([pending[:, None], d], dim=1)
        positions = cache.lengths[:, None] + torch.arange(n + 1, device=device)
        hid, _ = _forward(model, cache, tokens, positions, _causal(n + 1, device), ctx.timer)
        with ctx.timer("verify"):
            logits = model.unembed(hid)
        with ctx.timer("accept"):
            a, nxt = _accept_linear(logits, d, q, ctx.sampling, ctx.generator)
        with ctx.timer("cache"):
            cache.truncate(cache.lengths + a + 1)
            prev = tokens[torch.arange(len(a), device=device), a]  # the token before nxt
            # All committed tokens but the last two (pending is not in the target cache). n = 0
            # happens only in a row's last step, where the draft cache no longer matters.
            dcache.truncate(torch.minimum(dcache.lengths, cache.lengths - 1))
        emitted = [x[:k] + [t] for x, k, t in zip(d.tolist(), a.tolist(), nxt.tolist(),
                                                   strict=True)]
        pending = nxt
        rows, keep = _commit(ctx, rows, emitted, cache.lengths)


# --------------------------------------------------------------------------------------------
# Entry point


def _as_prompts(input_ids: torch.Tensor | Sequence[Sequence[int]]) -> list[list[int]]:
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (B, T) or (T,) (got shape "
                             f"{tuple(input_ids.shape)})")
        return input_ids.tolist()
    prompts = [list(map(int, p)) for p in input_ids]
    return prompts


@torch.no_grad()
def generate(
    model: MTPTransformer,
    input_ids: torch.Tensor | Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    decoder: str = "greedy",
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    n_heads: int | None = None,
    tree: Tree | None = None,
    draft_model: MTPTransformer | None = None,
    gamma: int = 4,
    eot_id: int | None = None,
    stop: Sequence[str] = (),
    decode: Callable[[list[int]], str] | None = None,
    generator: torch.Generator | None = None,
    on_tokens: Callable[[int, list[int]], None] | None = None,
) -> tuple[list[list[int]], DecodeStats]:
    """Continue each prompt by up to `max_new_tokens` tokens.

    Args:
        model: the target model (eval mode; any dtype, any device).
        input_ids: a (B, T) or (T,) tensor, or a list of token lists of any lengths.
        max_new_tokens: the most new tokens per row.
        decoder: `greedy`, `sample` (baselines, one token per forward), `self-spec` (heads 2..h
            draft a chain), `tree` (heads 2..h draft a tree) or `draft` (a separate model drafts).
        temperature: 0 or None is greedy for every decoder but `sample`, for which None means 1.
            Speculative decoders with temperature > 0 sample exactly from the same distribution
            as `sample`.
        top_k: sampling keeps the k most likely tokens.
        top_p: sampling keeps the nucleus of mass top_p.
        n_heads: heads used by `self-spec` and `tree`, 1..K (default K); h heads draft h - 1 tokens.
        tree: the candidate tree of `tree` (default `Tree.from_widths([3, 2, 1, 1, ...])`).
        draft_model: the drafting model of `draft` (its head 1 is used; same vocabulary).
        gamma: tokens the draft model proposes per round.
        eot_id: end-of-text token; a row stops after emitting it.
        stop: strings that end a row once its new text contains one (needs `decode`).
        decode: token ids -> text, for stop strings.
        generator: random generator for sampling (seed it for reproducible samples).
        on_tokens: called as on_tokens(row, tokens) whenever a row's tokens are accepted.

    Returns:
        Each row's new tokens (the stopping token included) and the decoding statistics.

    Raises:
        ValueError: with a message naming the bad argument.
    """
    prompts = _as_prompts(input_ids)
    cfg = model.cfg
    problems = []
    if decoder not in DECODERS:
        raise ValueError(f"unknown decoder {decoder!r}; choose one of {', '.join(DECODERS)}")
    if not prompts or any(len(p) == 0 for p in prompts):
        problems.append("every prompt needs at least one token")
    longest = max((len(p) for p in prompts), default=0)
    window = cfg.max_seq_len
    if decoder == "draft":
        if draft_model is None:
            problems.append("decoder 'draft' needs a draft model (--draft-ckpt)")
        else:
            if draft_model.cfg.vocab_size != cfg.vocab_size:
                problems.append(
                    f"the draft model's vocabulary ({draft_model.cfg.vocab_size}) differs from "
                    f"the target's ({cfg.vocab_size})"
                )
            window = min(window, draft_model.cfg.max_seq_len)
        if gamma < 1:
            problems.append(f"gamma must be >= 1 (got {gamma})")
    if longest >= window:
        problems.append(
            f"the prompt has {longest} tokens but the context window (--model.max_seq_len) is "
            f"{window}: no room for new tokens"
        )
    if max_new_tokens < 0:
        problems.append(f"max_new_tokens must be >= 0 (got {max_new_tokens})")
    if decoder in ("self-spec", "tree") and cfg.n_future == 1:
        problems.append(
            f"decoder {decoder!r} drafts with heads 2..K but this model has a single head "
            "(--model.n_future 1); use 'greedy', 'sample' or 'draft'"
        )
    heads = cfg.n_future if n_heads is None else n_heads
    if not 1 <= heads <= cfg.n_future:
        problems.append(f"n_heads must be in [1, {cfg.n_future}] (the model's --model.n_future) "
                        f"(got {heads})")
    if decoder == "sample" and temperature is None:
        temperature = 1.0
    temperature = temperature or 0.0
    if temperature < 0:
        problems.append(f"temperature must be >= 0 (got {temperature})")
    if decoder == "greedy" and temperature > 0:
        problems.append("decoder 'greedy' takes no temperature; use decoder 'sample'")
    if decoder == "sample" and temperature == 0:
        problems.append("decoder 'sample' needs temperature > 0; use decoder 'greedy'")
    if top_k is not None and top_k < 1:
        problems.append(f"top_k must be >= 1 (got {top_k})")
    if top_p is not None and not 0 < top_p <= 1:
        problems.append(f"top_p must be in (0, 1] (got {top_p})")
    if stop and decode is None:
        problems.append("stop strings need a `decode` function (token ids -> text)")
    if problems:
        raise ValueError("; ".join(problems))

    stats = DecodeStats()
    start = time.perf_counter()
    device = next(model.parameters()).device
    ctx = _Context(
        sampling=Sampling(temperature, top_k, top_p),
        stopper=_Stopper(len(prompts), max_new_tokens, eot_id, stop, decode, on_tokens),
        timer=_Timer(stats, device),
        stats=stats,
        generator=generator,
        window=window,
    )
    if max_new_tokens == 0:
        return [[] for _ in prompts], stats
    if decoder == "tree" and heads == 1:
        decoder = "self-spec"  # a tree without draft heads is the root alone
    # Room for every position of the window plus the tree slots past the last one.
    tree = tree or Tree.from_widths([3, 2] + [1] * max(0, cfg.n_future - 3))
    extra = len(tree.paths) if decoder == "tree" else max(heads, gamma) + 1
    max_len = min(window, longest + max_new_tokens) + extra
    if decoder in ("greedy", "sample"):
        _decode_plain(model, prompts, ctx, max_len)
    elif decoder == "self-spec":
        _decode_self_spec(model, prompts, ctx, max_len, heads)
    elif decoder == "tree":
        _decode_tree(model, prompts, ctx, max_len, heads, tree)
    else:
        _decode_draft(model, draft_model, prompts, ctx, max_len, gamma)
    stats.seconds = time.perf_counter() - start
    return ctx.stopper.out, stats


# --------------------------------------------------------------------------------------------
# Head accuracies (for choosing a tree)


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
        sequences: token sequences (each within the context window).
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


# --------------------------------------------------------------------------------------------
# Completions for the evaluation harness


class Completer:
    """Completes text prompts with one decoder of one checkpoint (see `load_completer`)."""

    def __init__(
        self,
        model: MTPTransformer,
        tokenizer,
        *,
        decoder: str = "greedy",
        draft_model: MTPTransformer | None = None,
        batch_size: int = 16,
        **decode_kwargs,
    ) -> None:
        from mtp.checkpoint import EOT_TOKEN

        self.model, self.tokenizer, self.decoder = model, tokenizer, decoder
        self.draft_model, self.batch_size = draft_model, batch_size
        self.decode_kwargs = decode_kwargs
        self.eot_id = tokenizer.token_to_id(EOT_TOKEN)
        self.stats = DecodeStats()

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def complete(
        self,
        prompts: list[str],
        *,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        stop: list[str],
        seed: int | None,
    ) -> list[str]:
        """Continue each prompt; each text ends before its first stop string or end-of-text.

        `greedy` and `sample` follow the temperature (0: greedy); speculative decoders sample
        exactly when temperature > 0. Prompts are decoded `batch_size` at a time, and the same
        seed gives the same completions.
        """
        decoder = self.decoder
        if decoder in ("greedy", "sample"):
            decoder = "sample" if temperature > 0 else "greedy"
        generator = torch.Generator(device=next(self.model.parameters()).device)
        if seed is None:
            generator.seed()
        else:
            generator.manual_seed(seed)
        window = self.model.cfg.max_seq_len
        out: list[str] = []
        for i in range(0, len(prompts), self.batch_size):
            ids = [self.tokenizer.encode(p).ids for p in prompts[i : i + self.batch_size]]
            # An over-long prompt keeps its end (the completion continues from there), leaving
            # room for the new tokens in the context window.
            room = max(window - max_new_tokens, window // 2)
            ids = [x[-room:] for x in ids]
            tokens, stats = generate(
                self.model, ids, max_new_tokens, decoder=decoder,
                temperature=temperature if temperature > 0 else None,
                top_p=top_p if temperature > 0 and top_p < 1 else None,
                draft_model=self.draft_model, eot_id=self.eot_id, stop=stop,
                decode=self._decode, generator=generator, **self.decode_kwargs,
            )
            self.stats.add(stats)
            for t in tokens:
                text = self._decode(t)
                cut = min((text.find(s) for s in stop if s in text), default=len(text))
                out.append(text[:cut])
        return out


def load_completer(
    ckpt_path: str,
    *,
    decoder: str,
    device: str = "cpu",
    draft_ckpt: str | None = None,
    batch_size: int = 16,
    **decode_kwargs,
) -> Completer:
    """A `Completer` over a checkpoint, for `mtp eval` (`draft_ckpt` is needed by `draft`)."""
    from mtp.checkpoint import load_checkpoint

    if decoder not in DECODERS:
        raise ValueError(f"unknown decoder {decoder!r}; choose one of {', '.join(DECODERS)}")
    model, tokenizer = load_checkpoint(ckpt_path, device=device)
    draft_model = None
    if decoder == "draft":
        if draft_ckpt is None:
            raise ValueError("decoder 'draft' needs a draft checkpoint (--draft-ckpt)")
        draft_model, draft_tok = load_checkpoint(draft_ckpt, device=device)
        if draft_tok.to_str() != tokenizer.to_str():
            raise ValueError(f"the draft checkpoint {draft_ckpt} has a different tokenizer")
    if decoder in ("self-spec", "tree") and model.cfg.n_future == 1:
        raise ValueError(
            f"{ckpt_path} has a single head (--model.n_future 1): decoder {decoder!r} needs "
            "extra heads"
        )
    return Completer(model, tokenizer, decoder=decoder, draft_model=draft_model,
                     batch_size=batch_size, **decode_kwargs)
