"""mtp: multi-token-prediction pretraining, decoding and evaluation."""
