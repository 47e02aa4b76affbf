"""Sampling on the device: per-row parameters as arrays, penalties, top-k/top-p/min-p, logprobs."""
