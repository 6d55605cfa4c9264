"""The model stage: the multi-token-prediction transformer in pure PyTorch and its checkpoints.

`transformer` holds the model (trunk, K output heads, shared norm and unembedding, KV cache), built
from `layers` (RMSNorm, RoPE, SwiGLU, attention, the block) and the output-head designs of `heads`;
`checkpoint` reads and writes mtp's checkpoints and reads its export directories, with
`llama_layout` (the model in transformers' Llama tensor names), `gguf` (llama.cpp's model files:
their shape, tokenizer and weights) and `vocab` (a tokenizer against a model). Everything above
reads checkpoints through here. Imports only `mtp.config` and `mtp.util`: no Lightning, Triton or
data code. Names are imported when first used.
"""

from mtp.util.lazy import lazy_exports

#: Each public name and the module that defines it.
_EXPORTS = {
    "KVCache": "mtp.model.transformer",
    "MODEL_REGISTRY": "mtp.config",
    "MTPTransformer": "mtp.model.transformer",
    "ModelConfig": "mtp.config",
    "build_model": "mtp.model.transformer",
    "load_checkpoint": "mtp.model.checkpoint",
    "save_checkpoint": "mtp.model.checkpoint",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
