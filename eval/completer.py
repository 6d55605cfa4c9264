"""Completions from an mtp checkpoint for the harness: any decoder, batched, seeded."""

from __future__ import annotations

import torch
from mtp.eval.chat import ChatTemplate

from mtp.decoding.generation import generate
from mtp.decoding.request import DecodeRequest
from mtp.decoding.stats import DecodeStats
from mtp.decoding.stopper import Stop
from mtp.model.transformer import MTPTransformer

__all__ = ["ModelCompleter", "load_completer"]


class ModelCompleter:
    """Completes text prompts with one decoder of one model (see `load_completer`); the
    `mtp.eval.harness.Completer` of `mtp eval --ckpt`."""

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
        from mtp.model.vocab import eot_id

        self.model, self.tokenizer, self.decoder = model, tokenizer, decoder
        self.draft_model, self.batch_size = draft_model, batch_size
        self.decode_kwargs = decode_kwargs
        self.eot_id = eot_id(tokenizer, model.cfg)
        self.stats = DecodeStats()
        # completions made, and of them: from a prompt cut to fit, stopped at the context length
        self.rows = self.prompts_cut = self.at_context_end = 0

    @property
    def chat_template(self) -> ChatTemplate | None:
        """The model's chat template (``ModelConfig.chat_template``), None where it has none."""
        cfg = self.model.cfg
        if not cfg.chat_template:
            return None
        return ChatTemplate(cfg.chat_template, eos_token=cfg.eot_token)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def complete(
        self,
        prompts: list[str],
        *,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        stop: list[Stop],
        seed: int | None,
    ) -> list[str]:
        """Continue each prompt; each text ends before its first stop string, or where a stop
        predicate first held, or at end-of-text.

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
        context_len = self.model.cfg.max_seq_len
        out: list[str] = []
        for i in range(0, len(prompts), self.batch_size):
            ids = [self.tokenizer.encode(p).ids for p in prompts[i : i + self.batch_size]]
            # An over-long prompt keeps its end (the completion continues from there), leaving
            # room for the new tokens in the context length.
            room = max(context_len - max_new_tokens, context_len // 2)
            self.rows += len(ids)
            self.prompts_cut += sum(len(x) > room for x in ids)
            ids = [x[-room:] for x in ids]
            tokens, stats = generate(
                self.model, ids, max_new_tokens, decoder=decoder,
                temperature=temperature if temperature > 0 else None,
                top_p=top_p if temperature > 0 and top_p < 1 else None,
                draft_model=self.draft_model, eot_id=self.eot_id, stop=stop,
                decode=self._decode, generator=generator, **self.decode_kwargs,
            )
            self.stats.add(stats)
            self.at_context_end += sum(len(x) + len(t) >= context_len for x, t in zip(ids, tokens))
            for t in tokens:
                text = self._decode(t)
                cut = min((text.find(s) for s in stop if isinstance(s, str) and s in text),
                          default=len(text))
                out.append(text[:cut])
        return out


def load_completer(
    ckpt_path: str,
    *,
    decoder: str,
    device: str = "cpu",
    dtype: str = "fp32",
    draft_ckpt: str | None = None,
    batch_size: int = 16,
    **decode_kwargs,
) -> ModelCompleter:
    """A `ModelCompleter` over a checkpoint, for `mtp eval` (`draft_ckpt` is needed by `draft`);
    `decode_kwargs` are the other fields of its `mtp.decoding.DecodeRequest` (heads, tree, gamma,
    lookup, ...), checked with the checkpoints here and passed to every `generate`. `dtype`:
    `--dtype`, the dtype to decode in (`mtp.decoding.arithmetic.decode_dtype`).

    Raises:
        RequestError: the decoder does not suit the checkpoints (`mtp.decoding.DecodeRequest`).
    """
    from mtp.decoding.arithmetic import decode_dtype, to_decode_dtype
    from mtp.model.checkpoint import load_checkpoint

    request = DecodeRequest(decoder=decoder, **decode_kwargs)
    request.check()
    torch_dtype = decode_dtype(dtype, device)
    model, tokenizer = load_checkpoint(ckpt_path, device=device)
    to_decode_dtype(model, torch_dtype)
    draft_model = draft_tokenizer = None
    if decoder == "draft" and draft_ckpt is not None:
        draft_model, draft_tokenizer = load_checkpoint(draft_ckpt, device=device)
        to_decode_dtype(draft_model, torch_dtype)
    request.check(model, draft_model, tokenizer=tokenizer, draft_tokenizer=draft_tokenizer)
    return ModelCompleter(model, tokenizer, decoder=decoder, draft_model=draft_model,
                          batch_size=batch_size, **decode_kwargs)
