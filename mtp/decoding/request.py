"""A decode request and its one validator.

`DecodeRequest` holds what `generate` is asked to do besides the model and the prompts: the
decoder and its settings. `DecodeRequest.problems` lists everything wrong with it given what is
known: before a model loads, the settings alone; then the model, the draft model and their
tokenizers; in `generate`, the prompts too. `check` raises them together as one `RequestError`.

Each problem names the field it is about, and its message calls fields by a name the caller
chooses: `generate` says `top_k must be >= 1 (got 0)`, and `mtp generate`, which maps each field
to its flag (`mtp.decoding.cli.flag`), says `--top-k must be >= 1 (got 0)` for the same rule.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from mtp.decoding.arithmetic import int8_available
from mtp.decoding.names import DECODERS, HEAD_DECODERS, LOOKUP_TOKENS, UNROLLED_MAX_HEADS
from mtp.decoding.tree import DynamicTree, Tree
from mtp.model.transformer import MTPTransformer
from mtp.util.errors import UserError

__all__ = ["MEASURING", "MIN_TEMPERATURE", "DecodeRequest", "Problem", "RequestError", "prose"]

#: Decoders `generate` takes that are not for use: `oracle` drafts a given reference (the tokens
#: greedy will emit), an upper bound that measures the loop's own cost.
MEASURING = ("oracle",)

#: The smallest temperature that samples: the logits are divided by it in fp32, and below this
#: the quotients of ordinary logits near the float32 limits overflow to inf, so the softmax
#: gives NaN (vLLM treats temperatures under the same 1e-5 as greedy). 0 is greedy.
MIN_TEMPERATURE = 1e-5

#: What `generate`'s messages call the fields that are not its arguments.
_PROSE = {"model": "the model", "prompts": "a prompt"}


def prose(name: str) -> str:
    """A field as `generate`'s messages call it: its argument's name, or words for the model and
    the prompts."""
    return _PROSE.get(name, name)


class _Names(dict):
    """Values by key; any other key is a field, called `names(field)`."""

    def __init__(self, names: Callable[[str], str], values: dict) -> None:
        super().__init__(values)
        self.names = names

    def __missing__(self, key: str) -> str:
        return self.names(key)


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a request: the field it is about, and a message in which `{field}`
    stands for a field's name and the other placeholders for the `values` it quotes."""

    field: str
    template: str
    values: dict

    def message(self, names: Callable[[str], str] = prose) -> str:
        return self.template.format_map(_Names(names, self.values))


class RequestError(ValueError, UserError):
    """Everything wrong with a decode request: `problems`, each naming its field."""

    def __init__(self, problems: Sequence[Problem]) -> None:
        self.problems = list(problems)
        super().__init__("; ".join(self.messages()))

    @property
    def fields(self) -> list[str]:
        return [p.field for p in self.problems]

    def messages(self, names: Callable[[str], str] = prose) -> list[str]:
        """Each problem in words, each field called `names(field)` (default: as `generate`
        calls it); a message that two problems share, once."""
        return list(dict.fromkeys(p.message(names) for p in self.problems))


@dataclass(frozen=True)
class DecodeRequest:
    """A decode request: the decoder and its settings (`generate`'s arguments of those names)."""

    max_new_tokens: int = 128
    """The most new tokens per row."""
    decoder: str = "greedy"
    """`greedy`, `sample`, `self-spec`, `tree`, `draft` or `lookup` (`mtp.decoding.names.DECODERS`).
    """
    temperature: float | None = None
    """0 or None is greedy for every decoder but `sample`, for which None means 1."""
    top_k: int | None = None
    """Sampling keeps the k most likely tokens."""
    top_p: float | None = None
    """Sampling keeps the nucleus of mass top_p."""
    heads: int | None = None
    """Heads used by `self-spec` and `tree`, 1..K (None: all K)."""
    tree: Tree | DynamicTree | None = None
    """The candidate tree of `tree` (None: `generate`'s default), or a tree grown each round."""
    gamma: int = 4
    """Tokens the draft model (or the oracle) proposes per round."""
    lookup: int = 0
    """Prompt lookup's most tokens per round: a branch beside the heads' drafts, or with decoder
    `lookup` its drafts (0: `LOOKUP_TOKENS`)."""
    lookup_ngram: int = 2
    """Prompt lookup matches the last lookup_ngram..1 tokens."""
    draft_int8: bool = False
    """Heads 2..h (whatever their type) draft with 8-bit integer products
    (`mtp.decoding.arithmetic.int8_products`); the output is unchanged."""

    @property
    def temperature_used(self) -> float:
        """The temperature decoding runs at: `temperature`, else 1 for `sample` and 0 for the
        others."""
        if self.temperature is None:
            return 1.0 if self.decoder == "sample" else 0.0
        return self.temperature

    @property
    def lookup_tokens(self) -> int:
        """Prompt lookup's most drafts per round (0: no lookup)."""
        return self.lookup or (LOOKUP_TOKENS if self.decoder == "lookup" else 0)

    def arguments(self) -> dict:
        """The request as `generate`'s keyword arguments (`max_new_tokens` goes first, by
        position)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name != "max_new_tokens"}

    def context_len(self, model: MTPTransformer, draft_model: MTPTransformer | None = None) -> int:
        """Positions a sequence may fill: the context length of the model (and of the draft
        model, for `draft`)."""
        n = model.cfg.max_seq_len
        if self.decoder == "draft" and draft_model is not None:
            n = min(n, draft_model.cfg.max_seq_len)
        return n

    def problems(
        self,
        model: MTPTransformer | None = None,
        draft_model: MTPTransformer | None = None,
        *,
        prompts: Sequence[Sequence[int]] | None = None,
        reference: Sequence[Sequence[int]] | None = None,
        stop: Sequence = (),
        decode: Callable | None = None,
        tokenizer=None,
        draft_tokenizer=None,
        measuring: bool = False,
    ) -> list[Problem]:
        """Everything wrong with the request, given what is known: the settings alone; with
        `model`, what the model (and the draft model, and their tokenizers where given) allows;
        with `prompts`, the prompts (and `reference`, `stop` and `decode`, as `generate` takes
        them). `measuring` admits the decoders of `MEASURING`."""
        found: list[Problem] = []

        def bad(name: str, template: str, **values) -> None:
            found.append(Problem(name, template, values))

        # The settings
        d, t = self.decoder, self.temperature_used
        if d not in DECODERS + (MEASURING if measuring else ()):
            bad("decoder", "{decoder}: unknown decoder {got!r}; choose one of {choices}", got=d,
                choices=", ".join(DECODERS))
        if self.max_new_tokens < 1:
            bad("max_new_tokens", "{max_new_tokens} must be >= 1 (got {got})",
                got=self.max_new_tokens)
        if not (math.isfinite(t) and t >= 0):
            bad("temperature", "{temperature} must be finite and >= 0 (got {got})", got=t)
        elif 0 < t < MIN_TEMPERATURE:
            bad("temperature", "{temperature} {got} is too small to divide the logits by (the "
                "quotients overflow float32 and sampling fails): give 0 for greedy decoding, or "
                "at least {least}", got=t, least=MIN_TEMPERATURE)
        elif d == "greedy" and t > 0:
            bad("temperature", "{temperature} > 0 samples: use {decoder} sample (or a speculative "
                "decoder, which then samples exactly)")
        elif d == "sample" and t == 0:
            bad("decoder", "{decoder} sample needs {temperature} > 0 (0 is {decoder} greedy)")
        elif d == "oracle" and t > 0:
            bad("temperature", "{decoder} oracle drafts greedy's tokens: it takes no "
                "{temperature}")
        if self.top_k is not None and self.top_k < 1:
            bad("top_k", "{top_k} must be >= 1 (got {got})", got=self.top_k)
        if self.top_p is not None and not 0 < self.top_p <= 1:
            bad("top_p", "{top_p} must be in (0, 1] (got {got})", got=self.top_p)
        if self.gamma < 1:
            bad("gamma", "{gamma} must be >= 1 (got {got})", got=self.gamma)
        if self.lookup < 0:
            bad("lookup", "{lookup} must be >= 0 (got {got})", got=self.lookup)
        elif self.lookup and d not in (*HEAD_DECODERS, "lookup"):
            bad("lookup", "{lookup} drafts beside {decoder} self-spec and tree or alone "
                "({decoder} lookup), not with {got!r}", got=d)
        if self.lookup_ngram < 1:
            bad("lookup_ngram", "{lookup_ngram} must be >= 1 (got {got})", got=self.lookup_ngram)
        if (self.lookup > 0 or d == "lookup") and t > 0:
            bad("lookup", "prompt lookup is verified greedily: it takes no {temperature}")
        if self.draft_int8 and d not in HEAD_DECODERS:
            bad("draft_int8", "{draft_int8} is how the heads draft with {decoder} self-spec "
                "and tree: {decoder} {got} drafts with no head", got=d)
        elif self.draft_int8 and not int8_available():
            bad("draft_int8", "{draft_int8}: torch {v} has no int8 product on the CPU (fbgemm)",
                v=torch.__version__)

        # What the model (and the draft model) allows
        if model is not None:
            cfg = model.cfg
            k = cfg.n_future
            if d in HEAD_DECODERS and k == 1:
                bad("decoder", "{decoder} {got} drafts with heads 2..K, but {model} has a single "
                    "head (--model.n_future 1); use greedy, sample, draft or lookup", got=d)
            elif self.heads is not None and model.unrolled and \
                    not 1 <= self.heads <= max(k, UNROLLED_MAX_HEADS):
                bad("heads", "{heads} must lie in [1, {n}]: eagle's layer drafts up to {steps} "
                    "steps (got {got})", n=max(k, UNROLLED_MAX_HEADS),
                    steps=max(k, UNROLLED_MAX_HEADS) - 1, got=self.heads)
            elif self.heads is not None and not model.unrolled and not 1 <= self.heads <= k:
                bad("heads", "{heads} must lie in [1, {k}]: {model} has {k} heads (got {got})",
                    k=k, got=self.heads)
            if self.lookup > 0 and d in HEAD_DECODERS and model.cascaded and \
                    not model.unrolled:
                bad("lookup", "{lookup} beside DeepSeek's modules (--model.head_type "
                    "{head_type}) is not supported; use parallel or eagle heads, or {decoder} "
                    "lookup",
                    head_type=cfg.head_type)
            if self.draft_int8 and d in HEAD_DECODERS:
                p = next(model.parameters())
                if p.device.type != "cpu" or p.dtype != torch.float32:
                    bad("draft_int8", "{draft_int8} multiplies on the CPU from fp32 weights; "
                        "{model} is {kind} on {device}", kind=str(p.dtype).removeprefix("torch."),
                        device=p.device)
            if d == "tree" and isinstance(self.tree, Tree) and self.tree.depth:
                widest = max(self.tree.widths())
                ranked = cfg.draft_vocab or cfg.vocab_size  # the tokens heads 2..K rank
                if widest > ranked:
                    bad("tree", "{tree} {got}: a level of {w} candidates is wider than the "
                        "vocabulary ({v} tokens)", got=",".join(map(str, self.tree.widths())),
                        w=widest, v=ranked)
            dtype = next(model.parameters()).dtype
            if d not in ("greedy", "sample") and dtype.itemsize < 4:
                bad("decoder", "{decoder} {got} verifies a round of drafts in one forward over "
                    "several tokens, and in {kind} that forward's rows do not round as greedy's "
                    "one-token forwards do (CPU kernels block attention and long products by the "
                    "number of rows; a last-bit difference is 0.4% in {kind}), so greedy's "
                    "output would not be kept: decode in fp32 (--dtype fp32), or greedy in "
                    "{kind}", got=d, kind=str(dtype).removeprefix("torch."))
            if d == "draft" and draft_model is None:
                bad("draft_model", "{decoder} draft needs {draft_model} (a small model with the "
                    "same tokenizer, to draft with)")
            elif d == "draft" and tokenizer is not None and draft_tokenizer is not None and \
                    draft_tokenizer.to_str() != tokenizer.to_str():
                bad("draft_model", "{draft_model} has a different tokenizer from {model}")
            elif d == "draft" and draft_model.cfg.vocab_size != cfg.vocab_size:
                bad("draft_model", "{draft_model} has a vocabulary of {dv} tokens, {model} of "
                    "{v}: they must be the same", dv=draft_model.cfg.vocab_size,
                    v=cfg.vocab_size)
            # A round's drafts are verified in one forward within the context: more could never
            # be verified, and their buffers would be sized by the flag, not by the model.
            room = self.context_len(model, draft_model)
            if d in ("draft", "oracle") and self.gamma >= room:
                bad("gamma", "{gamma} {got}: a round of more drafts than the context length "
                    "({n} tokens) holds cannot be verified", got=self.gamma, n=room)
            if self.lookup_tokens >= room:
                bad("lookup", "{lookup} {got}: a round of more drafts than the context length "
                    "({n} tokens) holds cannot be verified", got=self.lookup_tokens, n=room)

        # The prompts and what goes with them
        if prompts is not None:
            if not prompts:
                bad("prompts", "there is no prompt to continue")
            elif any(len(p) == 0 for p in prompts):
                bad("prompts", "{prompts} is empty")
            elif model is not None:
                longest, limit = max(map(len, prompts)), self.context_len(model, draft_model)
                if longest >= limit:
                    bad("prompts", "{prompts} has {n} tokens but the context length "
                        "(--model.max_seq_len) is {w}: no room for new tokens", n=longest,
                        w=limit)
            if d == "oracle" and (reference is None or len(reference) != len(prompts)):
                bad("reference", "{decoder} oracle needs {reference}: a continuation for every "
                    "prompt")
            if stop and decode is None:
                bad("decode", "{stop} needs {decode}: a function from token ids to text")
        return found

    def check(self, model: MTPTransformer | None = None,
              draft_model: MTPTransformer | None = None, **known) -> None:
        """Raise a `RequestError` with every problem of `problems(model, draft_model,
        **known)`, if any."""
        problems = self.problems(model, draft_model, **known)
        if problems:
            raise RequestError(problems)
