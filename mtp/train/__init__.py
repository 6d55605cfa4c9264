"""The training stage: the LightningModule and everything a training step or run needs.

`module` is the LightningModule (the step, the optimiser, the logging); `loss` every way of
computing the output heads' loss, chosen from one table; `targets` the heads' targets (the
data's, or the model's own greedy tokens); `frozen_trunk` the cached trunk outputs of
frozen-trunk training (`--optim.train heads`); `parallel` FSDP2; `fault` checkpoints that are
never half-written and runs that stop cleanly; `log_lines` progress lines for batch jobs; `cli`
the `mtp fit` and `mtp validate` commands (`fit_help` their stored `--help`). Imports the model,
data, kernels, decoding and interop stages.
"""
