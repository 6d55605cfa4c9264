"""mtp models in EleutherAI's lm-evaluation-harness: ``lm_eval --model mtp``.

`MTPLM` is registered as the lm-eval model ``mtp`` when this module is imported; ``mtp lm-eval``
is lm-eval's own command line with it imported, so::

    mtp lm-eval --model mtp --model_args ckpt=CKPT,decoder=self-spec,heads=4 --tasks TASK

runs any lm-eval task on an mtp checkpoint or export. Head 1 is the model: `loglikelihood` and
`loglikelihood_rolling` score text with its logits, as lm-eval's ``hf`` model scores a causal
LM, and `generate_until` decodes through `mtp.decoding.generate`, so a generation task can run
self-speculatively (``decoder=self-spec`` or ``tree``) with greedy's output. The other route is
``mtp export hf`` and ``--model hf --model_args pretrained=EXPORT_DIR``: the same
log-likelihoods and greedy generations, without the heads.

Needs the ``lmeval`` extra (``pip install -e ".[lmeval]"``).
"""

from __future__ import annotations

import sys

import lm_eval.models  # noqa: F401  (lm-eval's own models first: its registry fills lazily)
import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

__all__ = ["MTPLM", "main"]


def _flag(value, kind):
    """A ``--model_args`` value as lm-eval hands it over (a string, or already typed)."""
    if isinstance(value, str) and kind is bool:
        return value.lower() in ("1", "true", "yes")
    return kind(value)


@register_model("mtp")
class MTPLM(TemplateLM):
    """An mtp checkpoint or export as an lm-eval model.

    Args:
        ckpt: a ``.ckpt`` checkpoint or an ``mtp export hf`` directory.
        decoder: the `mtp.decoding` decoder of `generate_until` at temperature 0 (`greedy`,
            `self-spec`, `tree`); sampling requests use `sample`, or the speculative decoder's
            exact sampling.
        heads: heads used by `self-spec` and `tree` (default all).
        batch_size: requests scored or generated together.
        device: where the model runs (lm-eval's command line passes ``cuda`` unless told; on a
            machine without CUDA the model runs on the CPU, as lm-eval's ``hf`` model does).
        max_length: the context scored at once (default the model's window).
    """

    def __init__(self, ckpt: str, decoder: str = "greedy", heads: int | None = None,
                 batch_size: int | str = 8, device: str = "cpu", max_length: int | None = None,
                 **kwargs) -> None:
        super().__init__()
        from mtp.decoding.names import DECODERS
        from mtp.model.checkpoint import load_checkpoint
        from mtp.model.vocab import eot_id

        if decoder not in DECODERS:
            raise ValueError(f"--model_args decoder={decoder!r}: choose one of "
                             f"{', '.join(DECODERS)}")
        if str(device).startswith("cuda") and not torch.cuda.is_available():
            device = "cpu"
        self.model, self.tokenizer_ = load_checkpoint(ckpt, device=device)
        self.model.eval()
        self.decoder = decoder
        self.heads = None if heads is None else _flag(heads, int)
        self.batch_size = 8 if batch_size == "auto" else _flag(batch_size, int)
        self._device = torch.device(device)
        self._max_length = _flag(max_length, int) if max_length else self.model.cfg.max_seq_len
        self._eot = eot_id(self.tokenizer_, self.model.cfg)

    @property
    def eot_token_id(self) -> int:
        return self._eot

    @property
    def prefix_token_id(self) -> int:
        # scoring from an empty context starts after the end-of-text token (lm-eval's default
        # for a tokenizer without a BOS token, which an mtp tokenizer is)
        return self._eot

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return "mtp"

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs
                   ) -> list[int]:
        return self.tokenizer_.encode(string, add_special_tokens=False).ids

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer_.decode(tokens, skip_special_tokens=True)

    @torch.no_grad()
    def _logprobs(self, inputs: list[list[int]]) -> list[torch.Tensor]:
        """Head 1's log-probabilities (T, V) after each prefix of each input, a batch at a time
        (right-padded; causal attention keeps the padding out of every real position)."""
        out = []
        for i in range(0, len(inputs), self.batch_size):
            batch = inputs[i:i + self.batch_size]
            width = max(map(len, batch))
            ids = torch.tensor([x + [0] * (width - len(x)) for x in batch], device=self.device)
            logits = self.model(ids, heads=1)[0].float()  # (B, T, V)
            out += [F.log_softmax(row[:len(x)], -1) for row, x in zip(logits, batch)]
        return out

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs
                              ) -> list[tuple[float, bool]]:
        """(log P(continuation | context), whether it is the greedy continuation) of each
        ``(key, context_enc, continuation_enc)``; the context is cut from the left to fit."""
        inputs, spans = [], []
        for _, context, continuation in requests:
            whole = (context + continuation)[-(self.max_length + 1):]
            inputs.append(whole[:-1])
            spans.append(continuation[-len(whole) + 1:] if len(continuation) >= len(whole)
                         else continuation)
        results = []
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="loglikelihood")
        for logprobs, cont, key in zip(self._logprobs(inputs), spans, requests):
            rows = logprobs[len(logprobs) - len(cont):]  # (n, V): the continuation's positions
            target = torch.tensor(cont, device=rows.device)
            score = rows.gather(-1, target[:, None]).sum().item()
            greedy = bool((rows.argmax(-1) == target).all())
            results.append((score, greedy))
            if key[0] is not None:
                self.cache_hook.add_partial("loglikelihood", key[0], (score, greedy))
            bar.update()
        bar.close()
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """log P(text) of each request's whole text, in disjoint windows of the context length
        (each window seeing up to max_length earlier tokens), as lm-eval's ``hf`` model."""
        out = []
        for request in tqdm(requests, disable=disable_tqdm, desc="loglikelihood_rolling"):
            (text,) = request.args
            windows = [(None, *make_disjoint_window(w)) for w in get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1)]
            total = sum(s for s, _ in self._loglikelihood_tokens(windows, disable_tqdm=True))
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            out.append(total)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each request's continuation, up to its first ``until`` string or end-of-text, at most
        ``max_gen_toks`` tokens (default 256), decoded by `mtp.decoding.generate`."""
        from mtp.decoding.generation import generate

        out: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, r in enumerate(requests):  # one decode call per distinct set of arguments
            groups.setdefault(repr(sorted(r.args[1].items())), []).append(i)
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="generate_until")
        for members in groups.values():
            kwargs = dict(requests[members[0]].args[1])
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.pop("max_gen_toks", 256))
            temperature = float(kwargs.pop("temperature", 0.0) or 0.0)
            if not kwargs.pop("do_sample", temperature > 0):
                temperature = 0.0
            decoder = self.decoder
            if temperature > 0 and decoder == "greedy":
                decoder = "sample"
            room = max(1, self.max_length - max_new)
            for i in range(0, len(members), self.batch_size):
                batch = members[i:i + self.batch_size]
                prompts = [self.tok_encode(requests[j].args[0])[-room:] for j in batch]
                tokens, _ = generate(
                    self.model, prompts, min(max_new, self.max_length - max(map(len, prompts))),
                    decoder=decoder, heads=self.heads, temperature=temperature or None,
                    eot_id=self._eot, stop=[s for s in until if s], decode=self.tok_decode)
                for j, toks in zip(batch, tokens):
                    text = self.tok_decode([t for t in toks if t != self._eot])
                    for s in until:
                        if s:
                            text = text.split(s)[0]
                    out[j] = text
                    self.cache_hook.add_partial("generate_until", requests[j].args, text)
                    bar.update()
        bar.close()
        return out


def main(argv: list[str]) -> int:
    """``mtp lm-eval ARGS``: lm-eval's command line with the ``mtp`` model registered."""
    from lm_eval.__main__ import cli_evaluate

    sys.argv = ["lm_eval", *argv]
    cli_evaluate()
    return 0
