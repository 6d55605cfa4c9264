"""mtp: multi-token-prediction language models, trained, decoded and evaluated.

A transformer whose shared trunk feeds K output heads, head i predicting the token i positions
ahead (Gloeckle et al. 2024, "Better & Faster Large Language Models via Multi-token
Prediction"). The package trains such models from scratch with Lightning (a sequential pass
runs the heads one at a time through a fused linear-cross-entropy kernel, so no [tokens x
vocabulary] logits are held), decodes from them with the extra heads drafting for
self-speculative decoding, and evaluates them on HumanEval and MBPP in a sandbox.

The public contract, importable from here:

    ModelConfig, MTPTransformer           the model (mtp.config, mtp.model)
    mtp_inputs_targets, naive_mtp_loss,
    sequential_mtp_loss                   the MTP loss, naive and sequential (mtp.loss)
    linear_cross_entropy                  the fused kernel (mtp.kernels)
    generate, DECODERS                    one decode loop, every decoder (mtp.decoding)
    load_checkpoint, save_checkpoint      checkpoints without Lightning (mtp.checkpoint)
    pass_at_k                             the unbiased pass@k estimator (mtp.eval)

The command line is `mtp fit | validate | generate | eval | bench | export` (`mtp.cli`); the
configuration groups of `mtp fit` are the dataclasses of `mtp.config`. Names are imported when
first used, so `import mtp` (and every `mtp ... --help`) loads neither torch nor Lightning.
"""

from __future__ import annotations

import importlib

#: Each public name and the module that defines it.
_EXPORTS = {
    "ModelConfig": "mtp.config",
    "DECODERS": "mtp.config",
    "MTPTransformer": "mtp.model",
    "mtp_inputs_targets": "mtp.loss",
    "naive_mtp_loss": "mtp.loss",
    "sequential_mtp_loss": "mtp.loss",
    "linear_cross_entropy": "mtp.kernels",
    "generate": "mtp.decoding",
    "load_checkpoint": "mtp.checkpoint",
    "save_checkpoint": "mtp.checkpoint",
    "pass_at_k": "mtp.eval",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'mtp' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
