"""`mtp bench decode --prompts validation`: prompts cut from a checkpoint's validation text, and
the simulated acceptance (`mtp.train.loss.simulated_acceptance`) over the positions the decoders
draft from, so that the L decoding measures stands beside the L that validation logs.

The validation text is the one `mtp fit` validated on: the documents its data config holds out
(`mtp.data.corpus.in_validation`), read again and tokenised with the checkpoint's tokenizer, the
data's own (`mtp.train.module.TokenizerInCheckpoint`). A prompt is a window of it, and the
`--max-new-tokens` tokens after the window are its continuation in the text.
"""

from __future__ import annotations

from dataclasses import fields, replace
from pathlib import Path

import torch

from mtp.bench import PROMPT_TOKENS

__all__ = ["VALIDATION", "chain_acceptance", "simulated", "simulated_note", "validation_tokens",
           "validation_windows", "window_starts"]

#: The prompt source `--prompts validation`: windows of a checkpoint's validation text.
VALIDATION = "validation"


def validation_windows(p, args, model, tokenizer, given: str) -> list[list[int]]:
    """Windows of `--prompt-tokens` + `--max-new-tokens` tokens of the validation text of
    `--prompts validation[=given]`: `--limit` of them spread evenly over it, else every window
    end to end. Each is a prompt and the text that follows it."""
    from mtp.model.vocab import eot_id
    from mtp.util.errors import UserError

    n, new, window = args.prompt_tokens or PROMPT_TOKENS, args.max_new_tokens, \
        model.cfg.max_seq_len
    lengths = f"--prompt-tokens {n}{'' if args.prompt_tokens else ' (the default)'} + " \
              f"--max-new-tokens {new}"
    if n + new > window:
        p.error(f"{lengths} exceed the context length of --ckpt (--model.max_seq_len "
                f"{window})")
    data, where = validation_data(p, args.ckpt, given)
    try:
        tokens = validation_tokens(data, tokenizer, eot_id(tokenizer, model.cfg))
    except UserError as err:
        p.error(f"--prompts {VALIDATION}: the validation text of {where} cannot be read here "
                f"({err}); give the text to cut prompts from with --prompts {VALIDATION}=SOURCE "
                f"(a file, folder or glob of .py, .txt, .jsonl or .parquet files, or a Hugging "
                f"Face dataset, as --data.source takes it) or {VALIDATION}=CONFIG.yaml (a "
                f"config of `mtp fit`)")
    span = n + new
    if len(tokens) < span:
        p.error(f"{lengths} = {span} tokens: the validation text of {where} holds only "
                f"{len(tokens)}")
    if args.limit is not None and args.limit > len(tokens) - span + 1:
        p.error(f"--limit {args.limit}: the validation text of {where} ({len(tokens)} tokens) "
                f"holds {len(tokens) - span + 1} windows of {lengths} tokens")
    return [tokens[s:s + span] for s in window_starts(len(tokens), span, args.limit)]


def validation_data(p, ckpt: str, given: str):
    """The data config of `--prompts validation[=given]` and where it comes from, in words:
    the `data` of the config.yaml that `mtp fit` saved in the checkpoint's run folder (Lightning
    writes the checkpoints to its checkpoints/), of the fit config `given`, or that data with
    the source `given`."""
    from mtp.config import DataConfig

    if given.endswith((".yaml", ".yml")):
        return data_config(p, Path(given), f"--prompts {VALIDATION}={given}"), \
            f"the data in {given}"
    saved = Path(ckpt).parent.parent / "config.yaml"
    data = data_config(p, saved, f"--prompts {VALIDATION}: {saved}") if saved.is_file() \
        else None
    if given:
        return replace(data or DataConfig(), source=given, sources=None), given
    if data is None:
        p.error(f"--prompts {VALIDATION}: --ckpt {ckpt} has no config.yaml of `mtp fit` in its "
                f"run folder ({saved}), which names its data; give it with --prompts "
                f"{VALIDATION}=CONFIG.yaml (a config of `mtp fit`) or {VALIDATION}=SOURCE (as "
                f"--data.source takes it)")
    return data, f"the data in {saved}"


def data_config(p, path: Path, what: str):
    """The `data` section of the `mtp fit` config at `path`, as a `DataConfig`."""
    from mtp.config import DataConfig
    from mtp.util.errors import ConfigError, InputError
    from mtp.util.yaml_file import read_yaml_mapping

    try:
        data = read_yaml_mapping(path, what).get("data") or {}
    except InputError as err:
        p.error(str(err))
    if not isinstance(data, dict):
        p.error(f"{what}: its data is not a mapping of --data settings")
    unknown = sorted(set(data) - {f.name for f in fields(DataConfig)})
    if unknown:
        p.error(f"{what}: unknown --data settings {', '.join(unknown)}")
    try:
        return DataConfig(**data)
    except ConfigError as err:
        p.error(f"{what}: {err}")


def validation_tokens(data, tokenizer, eot: int) -> list[int]:
    """The validation text of the data config `data`: the documents of every source that the
    hash of their names holds out (`mtp.data.corpus.in_validation`), each source's in reading
    order, each document's tokens followed by `eot`, as `mtp fit` writes its validation shards.
    (Where `--data.max_tokens` stops a source early, the shards hold only the documents before
    the stop.)"""
    from mtp.data.corpus import DocumentReader, in_validation, source_specs
    from mtp.util.errors import InputError

    tokens: list[int] = []
    for spec in source_specs(data):
        docs = [text for name, text in DocumentReader(spec)
                if in_validation(name, spec.val_fraction)]
        if not docs:
            raise InputError(f"{spec.label} holds no validation document (--data.val_fraction "
                             f"{spec.val_fraction})")
        for encoded in tokenizer.encode_batch_fast(docs):
            tokens += [*encoded.ids, eot]
    return tokens


def window_starts(n_tokens: int, span: int, count: int | None) -> list[int]:
    """Starts of windows of `span` tokens in a text of `n_tokens`: `count` of them spread evenly
    from its first token to its last (distinct while count <= n_tokens - span + 1), or without
    a count every window end to end."""
    last = n_tokens - span
    if count is None:
        return list(range(0, last + 1, span))
    return [i * last // (count - 1) for i in range(count)] if count > 1 else [0]


@torch.no_grad()
def chain_acceptance(model, sequences: list[list[int]], starts: list[int]
                     ) -> tuple[torch.Tensor, int]:
    """Under teacher forcing on `sequences`, per draft depth d = 1..K-1, the share of positions
    at which heads 2..d+1 all draft what greedy emits (`mtp.train.loss.simulated_acceptance`), over
    the positions from starts[i] of each sequence to the last whose K - 1 next tokens it holds;
    and the number of those positions.

    A round drafts from the position of the last token it committed (the prefill from the
    prompt's last one): with each start at a prompt's last token, these are the positions the
    rounds may draft from. `simulated_acceptance` takes the share over every position of a
    window from its first, and the model is causal, so the count from `start` on is the count
    over the whole sequence less the count over the positions before `start`.
    """
    from mtp.train.loss import simulated_acceptance

    K, device = model.cfg.n_future, next(model.parameters()).device

    def count(seq: list[int], T: int) -> torch.Tensor:  # (K - 1,): over positions 0..T-1
        if T <= 0:
            return torch.zeros(K - 1, dtype=torch.float64)
        # (1, T + K); its last token is a target only, which simulated_acceptance never reads
        window = torch.tensor([[*seq[:T + K - 1], 0]], device=device)
        return (simulated_acceptance(model, window).double().cpu() * T).round()

    accepted, total = torch.zeros(K - 1, dtype=torch.float64), 0
    for seq, start in zip(sequences, starts, strict=True):
        end = len(seq) - K + 1  # positions 0..end-1 have their K - 1 next tokens in seq
        if end > start:
            accepted += count(seq, end) - count(seq, start)
            total += end - start
    return accepted / max(total, 1), total


def simulated(model, prompts: list[list[int]], outputs: list[list[int]],
              follows: list[list[int]] | None) -> dict[str, tuple[torch.Tensor, int]]:
    """`chain_acceptance` from each prompt's last token on, over greedy's continuations
    `outputs` (``greedy``) and, for validation prompts, over the text after them, `follows`
    (``text``)."""
    starts = [len(x) - 1 for x in prompts]
    sim = {"greedy": chain_acceptance(model, [x + o for x, o in zip(prompts, outputs,
                                                                     strict=True)], starts)}
    if follows is not None:
        sim["text"] = chain_acceptance(model, [x + f for x, f in zip(prompts, follows,
                                                                     strict=True)], starts)
    return sim


def simulated_note(sim: dict[str, tuple[torch.Tensor, int]]) -> str:
    """What the sim_L columns are, with the chain's rates behind them."""
    def rates(chain: torch.Tensor) -> str:
        given = chain / torch.cat([chain.new_ones(1), chain[:-1]])  # 0 / 0: nan, as decoded
        return (f"all of drafts 1..d accepted {'/'.join(f'{a:.3f}' for a in chain.tolist())}"
                f", draft d given the earlier {'/'.join(f'{a:.2f}' for a in given.tolist())}")

    texts = {"text": "the validation text after each prompt",
             "greedy": "greedy's own continuation (the text the rounds verify)"}
    return "\n".join(
        ["sim_L_text, sim_L_greedy: the L of a self-spec chain of h heads under teacher forcing "
         "(mtp.train.loss.simulated_acceptance, validation's val/sim_tokens_per_forward) over the "
         "positions the rounds may draft from, each prompt's last token on; L also counts the "
         "prefill's forward"]
        + [f"  {name}: {texts[name]}, {sim[name][1]} positions: {rates(sim[name][0])}"
           for name in texts if name in sim])
