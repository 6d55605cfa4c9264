"""Triton kernels, each beside its PyTorch reference (imported as ``mtp.kernels``)."""
