"""mtp: multi-token-prediction language models, trained, decoded and evaluated.

A transformer whose shared trunk feeds K output heads, head i predicting the token i positions
ahead (Gloeckle et al. 2024, "Better & Faster Large Language Models via Multi-token
Prediction"). The package trains such models from scratch with Lightning (a sequential pass
runs the heads one at a time through a fused linear-cross-entropy kernel, so no [tokens x
vocabulary] logits are held), decodes from them with the extra heads drafting for
self-speculative decoding, and evaluates them on HumanEval and MBPP in a sandbox.

The public contract, importable from here:

    ModelConfig, MTPTransformer,
    load_checkpoint, save_checkpoint      the model and its checkpoints (mtp.model)
    mtp_inputs_targets, naive_mtp_loss,
    sequential_mtp_loss                   the MTP loss, naive and sequential (mtp.loss)
    linear_cross_entropy                  the fused kernel (mtp.kernels)
    generate, DECODERS                    one decode loop, every decoder (mtp.decoding)
    pass_at_k                             the unbiased pass@k estimator (mtp.eval)

One folder per stage of the pipeline: `model/`, `data/`, `train/`, `decoding/`, `interop/`,
`bench/`, with `kernels/` and `eval/` at the repository's top; `docs/architecture.md` is the map.
The command line is `mtp fit | validate | generate | eval | bench | export` (`mtp.cli`); the
configuration groups of `mtp fit` are the dataclasses of `mtp.config`. Names are imported when
first used, so `import mtp` (and every `mtp ... --help`) loads neither torch nor Lightning.
"""

from __future__ import annotations

from mtp.util.lazy import lazy_exports

#: Each public name and the module that defines it.
_EXPORTS = {
    "ModelConfig": "mtp.config",
    "DECODERS": "mtp.decoding.names",
    "MTPTransformer": "mtp.model.transformer",
    "mtp_inputs_targets": "mtp.train.targets",
    "naive_mtp_loss": "mtp.train.loss",
    "sequential_mtp_loss": "mtp.train.loss",
    "linear_cross_entropy": "mtp.kernels",
    "generate": "mtp.decoding.generation",
    "load_checkpoint": "mtp.model.checkpoint",
    "save_checkpoint": "mtp.model.checkpoint",
    "pass_at_k": "mtp.eval",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
