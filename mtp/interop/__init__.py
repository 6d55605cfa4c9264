"""The interop stage: mtp models in and out of other libraries.

`hf_import` starts a model from a pretrained transformers checkpoint or a GGUF file
(`mtp.model.gguf` reads those);
`hf_export` writes a checkpoint as a transformers directory, `vllm_medusa` heads 2..K as vLLM's
Medusa draft model (`cli`: `mtp export`); `lm_eval_model` is the `mtp` model of EleutherAI's
lm-evaluation-harness (`mtp lm-eval`); `distill` writes a self-distillation corpus of a model's
own answers (`mtp distill`). Imports the model, data, decoding and evaluation stages; never
Lightning.
"""
