"""Code-benchmark evaluation (imported as ``mtp.eval``)."""
