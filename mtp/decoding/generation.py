"""`generate`: one decode request, validated once (`request`), run by the one decode loop
(`engine`) with the drafter the decoder names."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from mtp.decoding.arithmetic import decode_linears, int8_products
from mtp.decoding.cascaded import CascadedHeads
from mtp.decoding.drafters import (
    Drafter,
    DraftModel,
    Oracle,
    ParallelHeads,
    ParallelHeadsDynamicTree,
    ParallelHeadsTree,
)
from mtp.decoding.eagle import EagleHeads
from mtp.decoding.engine import Context, new_cache, run
from mtp.decoding.lookup import Lookup, LookupChain
from mtp.decoding.policy import Adaptive, Fixed
from mtp.decoding.request import HEAD_DECODERS, DecodeRequest
from mtp.decoding.sampling import Sampling
from mtp.decoding.stats import DecodeStats, Timer
from mtp.decoding.stopper import EndListener, Listener, Stop, Stopper
from mtp.decoding.tree import DynamicTree, Tree
from mtp.model.transformer import MTPTransformer

__all__ = ["generate"]


def _as_prompts(input_ids: torch.Tensor | Sequence[Sequence[int]]) -> list[list[int]]:
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (B, T) or (T,) (got shape "
                             f"{tuple(input_ids.shape)})")
        return input_ids.tolist()
    return [list(map(int, p)) for p in input_ids]


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
    tree: Tree | DynamicTree | None = None,
    draft_model: MTPTransformer | None = None,
    gamma: int = 4,
    adaptive: bool | Adaptive = False,
    reference: Sequence[Sequence[int]] | None = None,
    lookup: int = 0,
    lookup_ngram: int = 2,
    draft_int8: bool = False,
    eot_id: int | None = None,
    stop: Sequence[Stop] = (),
    decode: Callable[[list[int]], str] | None = None,
    generator: torch.Generator | None = None,
    on_tokens: Listener | None = None,
    on_end: EndListener | None = None,
    max_batch: int | None = None,
) -> tuple[list[list[int]], DecodeStats]:
    """Continue each prompt by up to `max_new_tokens` tokens.

    Args:
        model: the target model (eval mode; any dtype, any device).
        input_ids: a (B, T) or (T,) tensor, or a list of token lists of any lengths.
        max_new_tokens: the most new tokens per row (>= 1).
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
        tree: the candidate tree of `tree` (default `Tree.from_widths([3, 2, 1, 1, ...])`), or a
            `DynamicTree` grown each round where the heads are sure (parallel heads).
        draft_model: the drafting model of `draft` (its head 1 is used; same vocabulary).
        gamma: tokens the draft model (or the oracle) proposes per round.
        adaptive: each round verifies only as many drafts as pay at the current batch size and
            acceptance (`mtp.decoding.policy.Adaptive`); the output is unchanged. Pass one
            `Adaptive` to many calls to keep what it measured from call to call.
        reference: each row's continuation for `oracle` (e.g. greedy's output).
        lookup: with `self-spec` or `tree`, also verify up to this many tokens copied by
            prompt lookup, as one more branch of the round's tree; with `lookup`, the most
            drafts a round copies (0: `LOOKUP_TOKENS`). Greedy only.
        lookup_ngram: prompt lookup matches the last lookup_ngram..1 tokens.
        draft_int8: heads 2..h (eagle's layer, DeepSeek's modules, or parallel heads)
            draft with 8-bit integer products on the CPU
            (`mtp.decoding.arithmetic.int8_products`): their weights read in a quarter of the
            bytes, the drafts a little less sure; the output is unchanged.
        eot_id: end-of-text token; a row stops after emitting it.
        stop: strings that end a row once its new text contains one, or predicates that end it
            once they hold of its new text and stay true as it grows (needs `decode`).
        decode: token ids -> text, for stop strings.
        generator: random generator for sampling (seed it for reproducible samples).
        on_tokens: the streaming hook, called as on_tokens(row, tokens, origins) once per round
            with each row's new tokens (the prefill's token, then the accepted drafts and the
            verifier's token of each round, stops applied) and each token's origin
            (`mtp.decoding.origin`: `HEAD_1` for the verifier's own, k for a draft of head k,
            `LOOKUP`, `DRAFT_MODEL`, `ORACLE`). Without it the loop gathers no origin. Raising
            in it ends the call (e.g. to stop a decode nobody watches any more).
        on_end: called as on_end(row, tokens) once a row has ended, with its new tokens as
            returned (e.g. to write each answer as soon as it is final).
        max_batch: decode at most this many prompts at once: the first ones together, and as
            rows end, the next prompts, prefilled a group at a time, take their places
            (continuous batching, `mtp.decoding.engine.run`), so that no round runs with few
            rows while prompts wait. Greedy and sample only. None: all at once.

    Returns:
        Each row's new tokens (the stopping token included) and the decoding statistics.

    Raises:
        RequestError: a `ValueError` with every problem of the request (`DecodeRequest`), each
            naming its argument.
    """
    prompts = _as_prompts(input_ids)
    request = DecodeRequest(max_new_tokens=max_new_tokens, decoder=decoder, temperature=temperature,
                            top_k=top_k, top_p=top_p, heads=heads, tree=tree, gamma=gamma,
                            lookup=lookup, lookup_ngram=lookup_ngram, draft_int8=draft_int8)
    request.check(model, draft_model, prompts=prompts, reference=reference, stop=stop,
                  decode=decode, measuring=True)
    if max_batch is not None and (max_batch < 1 or decoder not in ("greedy", "sample")):
        raise ValueError(f"max_batch must be >= 1 and goes with decoder greedy or sample (got "
                         f"{max_batch} with {decoder})")
    heads = model.cfg.n_future if heads is None else heads
    context_len = request.context_len(model, draft_model)
    longest = max(len(p) for p in prompts)

    stats = DecodeStats()
    start = time.perf_counter()
    one_head = decoder in HEAD_DECODERS and heads == 1
    if decoder in ("greedy", "sample") or (one_head and not lookup):
        # One head drafts nothing: plain decoding.
        drafter = Drafter()
    elif decoder == "lookup" or one_head:
        drafter = LookupChain(Lookup(request.lookup_tokens, lookup_ngram))
    elif decoder in ("self-spec", "tree") and model.unrolled:
        if decoder == "tree":
            tree = tree or Tree.from_widths([3, 2] + [1] * max(0, model.cfg.n_future - 3))
        drafter = EagleHeads(model, heads, tree if decoder == "tree" else None,
                             Lookup(lookup, lookup_ngram) if lookup else None)
    elif decoder == "self-spec" and lookup:
        # The heads' chain and the lookup's continuation: a tree of two branches.
        drafter = ParallelHeadsTree(model, heads, Tree.from_widths([1] * (heads - 1)),
                                    Lookup(lookup, lookup_ngram))
    elif decoder == "self-spec":
        drafter = CascadedHeads(model, heads) if model.cascaded else ParallelHeads(model, heads)
    elif decoder == "tree" and isinstance(tree, DynamicTree) and not model.cascaded:
        drafter = ParallelHeadsDynamicTree(model, heads, tree,
                                           Lookup(lookup, lookup_ngram) if lookup else None)
    elif decoder == "tree":
        tree = tree or Tree.from_widths([3, 2] + [1] * max(0, model.cfg.n_future - 3))
        drafter = CascadedHeads(model, heads, tree) if model.cascaded else \
            ParallelHeadsTree(model, heads, tree, Lookup(lookup, lookup_ngram) if lookup else None)
    elif decoder == "draft":
        drafter = DraftModel(draft_model, gamma)
    else:
        drafter = Oracle(reference, gamma)
    # Room for every position of the context plus the slots a round writes past the last one.
    extra = drafter.slots_needed
    max_len = min(context_len, longest + max_new_tokens) + extra
    device = next(model.parameters()).device
    ctx = Context(
        model=model,
        cache=new_cache(model, min(len(prompts), max_batch or len(prompts)), max_len),
        sampling=Sampling(request.temperature_used, top_k, top_p),
        stopper=Stopper(len(prompts), max_new_tokens, eot_id, stop, decode, on_tokens, on_end),
        timer=Timer(stats, device),
        stats=stats,
        generator=generator,
        context_len=context_len,
        rows=list(range(len(prompts))),
    )
    if isinstance(adaptive, Adaptive):
        policy = adaptive
    else:
        policy = Adaptive() if adaptive else Fixed()
    with int8_products(drafter.int8_linears if draft_int8 else []), \
            decode_linears(model, draft_model, drafter.layers):
        run(ctx, prompts, drafter, policy)
    stats.seconds = time.perf_counter() - start
    return ctx.stopper.out, stats

