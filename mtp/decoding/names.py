"""The decoders by name and their defaults, importable without torch (every `--help` reads
them)."""

from __future__ import annotations

#: The decoders of `mtp.decoding.generate` (`mtp generate --decoder`).
DECODERS = ("greedy", "sample", "self-spec", "tree", "draft", "lookup")

#: Prompt lookup's most drafts per round where none is given (`--lookup 0`): decoder `lookup`, and
#: transformers' prompt lookup in `mtp bench decode --transformers`.
LOOKUP_TOKENS = 10

#: The decoders that draft with the model's own heads 2..h.
HEAD_DECODERS = ("self-spec", "tree")

#: The most heads (h; h - 1 draft steps) eagle's one layer drafts with (`--model.head_type
#: eagle`): it runs once per step, so it drafts deeper than the K - 1 steps it was trained
#: unrolled over where asked (EAGLE drafts 5 to 6 deep from a layer trained on fewer steps).
UNROLLED_MAX_HEADS = 16

#: The products a decode forward's linear layers can run on (`mtp.decoding.arithmetic`).
LINEAR_PATHS = ("plain", "onednn", "mkl")

#: The dtypes a model decodes in (`--dtype`; `mtp.decoding.arithmetic.DTYPES`).
DTYPE_NAMES = ("fp32", "bf16")
