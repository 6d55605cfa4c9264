"""transformers' own `generate` beside mtp's decoders in `mtp bench decode --transformers`: the
reference implementation on the same weights, in the same dtype."""

from __future__ import annotations

import time

import torch

from mtp.decoding.stats import DecodeStats
from mtp.decoding.stopper import Stopper

__all__ = ["TransformersDecoder"]


class TransformersDecoder:
    """transformers' `generate` on the weights of head 1: the `LlamaForCausalLM` of
    `mtp.model.llama_layout`, built in memory, decoding one prompt a call where mtp's decoders stop
    (end-of-text, max new tokens, the context length, stop strings), with its forwards counted for
    L."""

    def __init__(self, model, tokenizer, eot: int, stop: list[str], decode,
                 lookup: dict[str, int]) -> None:
        import transformers

        from mtp.model.llama_layout import llama_config, llama_state

        state = llama_state(model)  # refuses what the Llama layout cannot hold
        config = dict(llama_config(model.cfg, tokenizer, model.embed.weight.dtype))
        config = transformers.AutoConfig.for_model(config.pop("model_type"), **config)
        self.model = transformers.AutoModelForCausalLM.from_config(config)
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        # Tied embeddings: transformers ties lm_head to the embedding itself.
        if set(missing) - ({"lm_head.weight"} if model.cfg.tie_embeddings else set()) \
                or unexpected:
            raise RuntimeError(f"transformers' {type(self.model).__name__} does not take head "
                               f"1's weights (missing {missing[:4]}, unexpected {unexpected[:4]})")
        self.model.to(device=model.embed.weight.device, dtype=model.embed.weight.dtype).eval()
        self.device, self.window = model.embed.weight.device, model.cfg.max_seq_len
        self.eot, self.stop, self.decode, self.lookup = eot, stop, decode, lookup
        self.forwards, self.prompt_len = 0, 0
        self.model.register_forward_hook(self._count)
        criteria = transformers.StoppingCriteriaList()
        if stop:
            stopped = self._stopped

            class StopStrings(transformers.StoppingCriteria):
                def __call__(self, input_ids, scores, **kwargs):
                    return stopped(input_ids)

            criteria.append(StopStrings())
        self.criteria = criteria

    def _count(self, *_) -> None:
        self.forwards += 1

    def _stopped(self, input_ids: torch.Tensor) -> torch.Tensor:
        text = self.decode(input_ids[0, self.prompt_len:].tolist())
        done = any(s in text for s in self.stop)
        return torch.full((len(input_ids),), done, dtype=torch.bool, device=input_ids.device)

    def __call__(self, decoder: str, prompt: list[int], max_new_tokens: int
                 ) -> tuple[list[list[int]], DecodeStats]:
        """`decoder` (greedy or prompt-lookup) on one prompt: [new tokens] and what it did."""
        # mtp ends a row whose sequence fills the context length; so does this.
        n = min(max_new_tokens, self.window - len(prompt))
        ids = torch.tensor([prompt], device=self.device)
        self.forwards, self.prompt_len = 0, len(prompt)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        seq = self.model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
            eos_token_id=self.eot, pad_token_id=self.eot, stopping_criteria=self.criteria,
            **(self.lookup if decoder == "prompt-lookup" else {}))
        new = seq[0, len(prompt):].tolist()
        seconds = time.perf_counter() - start
        # A round of prompt lookup may accept tokens past a stop string: cut where mtp's
        # stopper would (the time keeps the tokens past it, as it keeps a draft's).
        stopper = Stopper(1, n, self.eot, self.stop, self.decode, None)
        stopper.extend(0, new)
        out = stopper.out[0]
        return [out], DecodeStats(tokens=len(out), forwards=self.forwards,
                                  row_forwards=self.forwards, prefills=1, seconds=seconds)
