"""Decoding: greedy and sampling baselines, self-speculation (chain, tree), draft-model speculation.

`generate` validates a request and runs the one decode loop (`engine`) with one drafter
(`drafters`): plain decoding proposes nothing; `self-spec` and `tree` draft with heads 2..h
(parallel heads run as one stacked block, `heads`; chained heads run on their own drafts,
`chain`); `draft` with a separate model; `lookup` copies drafts from the text so far (prompt
lookup, `lookup`), alone or as one more branch beside the heads' drafts. The acceptance rules
(`acceptance`) are exact: speculative greedy output is plain greedy output token for token, and
speculative sampling draws from the distribution of plain sampling (`sampling`). `tree` holds the
candidate trees, `stopper` the stop conditions, `stats` what a call did, and `policy` how many
drafts a round verifies (all it can, or as many as pay).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from mtp.config import DECODERS
from mtp.decoding.chain import ChainHeads
from mtp.decoding.drafters import Drafter, DraftModel, HeadChain, HeadTree, Oracle
from mtp.decoding.engine import Context, new_cache, run
from mtp.decoding.lookup import Lookup, LookupChain
from mtp.decoding.packed import packed_linears
from mtp.decoding.policy import Adaptive, Fixed
from mtp.decoding.sampling import Sampling, probs_from_logits, sample_from_logits
from mtp.decoding.stats import PHASES, DecodeStats, Timer
from mtp.decoding.stopper import Stop, Stopper
from mtp.decoding.tree import Tree, head_accuracy
from mtp.model import MTPTransformer

__all__ = [
    "DECODERS",
    "PHASES",
    "DecodeStats",
    "Sampling",
    "Tree",
    "generate",
    "head_accuracy",
    "probs_from_logits",
    "sample_from_logits",
]

#: Decoders `generate` also takes that are not for use: `oracle` drafts a given reference (the
#: tokens greedy will emit), an upper bound that measures the loop's own cost.
_MEASURING = ("oracle",)


def _as_prompts(input_ids: torch.Tensor | Sequence[Sequence[int]]) -> list[list[int]]:
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (B, T) or (T,) (got shape "
                             f"{tuple(input_ids.shape)})")
        return input_ids.tolist()
    return [list(map(int, p)) for p in input_ids]


def _problems(model, prompts, decoder, *, max_new_tokens, temperature, top_k, top_p, heads,
              draft_model, gamma, reference, stop, decode, lookup, lookup_ngram) -> list[str]:
    """Everything wrong with a request, each naming its argument."""
    cfg = model.cfg
    problems = []
    if not prompts or any(len(p) == 0 for p in prompts):
        problems.append("every prompt needs at least one token")
    if decoder == "draft":
        if draft_model is None:
            problems.append("decoder 'draft' needs a draft model (--draft-ckpt)")
        elif draft_model.cfg.vocab_size != cfg.vocab_size:
            problems.append(f"the draft model's vocabulary ({draft_model.cfg.vocab_size}) "
                            f"differs from the target's ({cfg.vocab_size})")
    if decoder in ("draft", "oracle") and gamma < 1:
        problems.append(f"gamma must be >= 1 (got {gamma})")
    if decoder == "oracle" and (reference is None or len(reference) != len(prompts)):
        problems.append("decoder 'oracle' needs a reference continuation for every prompt")
    if max_new_tokens < 0:
        problems.append(f"max_new_tokens must be >= 0 (got {max_new_tokens})")
    if decoder in ("self-spec", "tree") and cfg.n_future == 1:
        problems.append(
            f"decoder {decoder!r} drafts with heads 2..K but this model has a single head "
            "(--model.n_future 1); use 'greedy', 'sample' or 'draft'"
        )
    if not 1 <= heads <= cfg.n_future:
        problems.append(f"heads must be in [1, {cfg.n_future}] (the model's --model.n_future) "
                        f"(got {heads})")
    if temperature < 0:
        problems.append(f"temperature must be >= 0 (got {temperature})")
    if decoder == "greedy" and temperature > 0:
        problems.append("decoder 'greedy' takes no temperature; use decoder 'sample'")
    if decoder == "sample" and temperature == 0:
        problems.append("decoder 'sample' needs temperature > 0; use decoder 'greedy'")
    if decoder == "oracle" and temperature > 0:
        problems.append("decoder 'oracle' drafts greedy's tokens: it takes no temperature")
    if top_k is not None and top_k < 1:
        problems.append(f"top_k must be >= 1 (got {top_k})")
    if top_p is not None and not 0 < top_p <= 1:
        problems.append(f"top_p must be in (0, 1] (got {top_p})")
    if stop and decode is None:
        problems.append("stops need a `decode` function (token ids -> text)")
    if lookup < 0 or lookup_ngram < 1:
        problems.append(f"lookup must be >= 0 and lookup_ngram >= 1 (got {lookup}, "
                        f"{lookup_ngram})")
    if lookup and decoder not in ("self-spec", "tree", "lookup"):
        problems.append(f"lookup drafts beside decoders 'self-spec' and 'tree' or alone "
                        f"('lookup'), not with {decoder!r}")
    if (lookup or decoder == "lookup") and temperature > 0:
        problems.append("prompt lookup is verified greedily: it takes no temperature")
    if lookup and decoder in ("self-spec", "tree") and model.chained:
        problems.append(f"lookup beside chained heads (--model.head_type "
                        f"{cfg.head_type}) is not supported; use parallel heads or 'lookup'")
    return problems


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
    heads: int | None = None,
    tree: Tree | None = None,
    draft_model: MTPTransformer | None = None,
    gamma: int = 4,
    adaptive: bool | Adaptive = False,
    reference: Sequence[Sequence[int]] | None = None,
    lookup: int = 0,
    lookup_ngram: int = 2,
    eot_id: int | None = None,
    stop: Sequence[Stop] = (),
    decode: Callable[[list[int]], str] | None = None,
    generator: torch.Generator | None = None,
    on_tokens: Callable[[int, list[int], int], None] | None = None,
) -> tuple[list[list[int]], DecodeStats]:
    """Continue each prompt by up to `max_new_tokens` tokens.

    Args:
        model: the target model (eval mode; any dtype, any device).
        input_ids: a (B, T) or (T,) tensor, or a list of token lists of any lengths.
        max_new_tokens: the most new tokens per row.
        decoder: `greedy`, `sample` (baselines, one token per forward), `self-spec` (heads 2..h
            draft a chain), `tree` (heads 2..h draft a tree) or `draft` (a separate model drafts).
            `lookup` drafts by prompt lookup alone (`mtp.decoding.lookup`). `oracle` drafts
            `reference` instead: an upper bound for measuring the loop itself.
        temperature: 0 or None is greedy for every decoder but `sample`, for which None means 1.
            Speculative decoders with temperature > 0 sample exactly from the same distribution
            as `sample`.
        top_k: sampling keeps the k most likely tokens.
        top_p: sampling keeps the nucleus of mass top_p.
        heads: heads used by `self-spec` and `tree`, 1..K (default K); h heads draft h - 1 tokens.
        tree: the candidate tree of `tree` (default `Tree.from_widths([3, 2, 1, 1, ...])`).
        draft_model: the drafting model of `draft` (its head 1 is used; same vocabulary).
        gamma: tokens the draft model (or the oracle) proposes per round.
        adaptive: each round verifies only as many drafts as pay at the current batch size and
            acceptance (`mtp.decoding.policy.Adaptive`); the output is unchanged. Pass one
            `Adaptive` to many calls to keep what it measured from call to call.
        reference: each row's continuation for `oracle` (e.g. greedy's output).
        lookup: with `self-spec` or `tree`, also verify up to this many tokens copied by
            prompt lookup, as one more branch of the round's tree; with `lookup`, the most
            drafts a round copies (default 10). Greedy only.
        lookup_ngram: prompt lookup matches the last lookup_ngram..1 tokens.
        eot_id: end-of-text token; a row stops after emitting it.
        stop: strings that end a row once its new text contains one, or predicates that end it
            once they hold of its new text and stay true as it grows (needs `decode`).
        decode: token ids -> text, for stop strings.
        generator: random generator for sampling (seed it for reproducible samples).
        on_tokens: called as on_tokens(row, tokens, drafted) whenever a row's tokens are
            accepted; the first `drafted` of them came from accepted drafts, the last from the
            verifier.

    Returns:
        Each row's new tokens (the stopping token included) and the decoding statistics.

    Raises:
        ValueError: with a message naming the bad argument.
    """
    prompts = _as_prompts(input_ids)
    if decoder not in DECODERS + _MEASURING:
        raise ValueError(f"unknown decoder {decoder!r}; choose one of {', '.join(DECODERS)}")
    heads = model.cfg.n_future if heads is None else heads
    if decoder == "sample" and temperature is None:
        temperature = 1.0
    temperature = temperature or 0.0
    problems = _problems(model, prompts, decoder, max_new_tokens=max_new_tokens,
                         temperature=temperature, top_k=top_k, top_p=top_p, heads=heads,
                         draft_model=draft_model, gamma=gamma, reference=reference, stop=stop,
                         decode=decode, lookup=lookup, lookup_ngram=lookup_ngram)
    window = model.cfg.max_seq_len
    if decoder == "draft" and draft_model is not None:
        window = min(window, draft_model.cfg.max_seq_len)
    longest = max((len(p) for p in prompts), default=0)
    if prompts and longest >= window:
        problems.append(
            f"the prompt has {longest} tokens but the context window (--model.max_seq_len) is "
            f"{window}: no room for new tokens"
        )
    if problems:
        raise ValueError("; ".join(problems))

    stats = DecodeStats()
    start = time.perf_counter()
    if max_new_tokens == 0:
        return [[] for _ in prompts], stats
    one_head = decoder in ("self-spec", "tree") and heads == 1
    if decoder in ("greedy", "sample") or (one_head and not lookup):
        # One head drafts nothing: plain decoding.
        drafter = Drafter()
    elif decoder == "lookup" or one_head:
        drafter = LookupChain(Lookup(lookup or 10, lookup_ngram))
    elif decoder == "self-spec" and lookup:
        # The heads' chain and the lookup's continuation: a tree of two branches.
        drafter = HeadTree(model, heads, Tree.from_widths([1] * (heads - 1)),
                           Lookup(lookup, lookup_ngram))
    elif decoder == "self-spec":
        drafter = ChainHeads(model, heads) if model.chained else HeadChain(model, heads)
    elif decoder == "tree":
        tree = tree or Tree.from_widths([3, 2] + [1] * max(0, model.cfg.n_future - 3))
        drafter = ChainHeads(model, heads, tree) if model.chained else \
            HeadTree(model, heads, tree, Lookup(lookup, lookup_ngram) if lookup else None)
    elif decoder == "draft":
        drafter = DraftModel(draft_model, gamma)
    else:
        drafter = Oracle(reference, gamma)
    # Room for every position of the window plus the slots a round writes past the last one.
    extra = drafter.slots_needed
    max_len = min(window, longest + max_new_tokens) + extra
    device = next(model.parameters()).device
    ctx = Context(
        model=model,
        cache=new_cache(model, len(prompts), max_len),
        sampling=Sampling(temperature, top_k, top_p),
        stopper=Stopper(len(prompts), max_new_tokens, eot_id, stop, decode, on_tokens),
        timer=Timer(stats, device),
        stats=stats,
        generator=generator,
        window=window,
        rows=list(range(len(prompts))),
    )
    if isinstance(adaptive, Adaptive):
        policy = adaptive
    else:
        policy = Adaptive() if adaptive else Fixed()
    with packed_linears(model, draft_model):
        run(ctx, prompts, drafter, policy)
    stats.seconds = time.perf_counter() - start
    return ctx.stopper.out, stats

