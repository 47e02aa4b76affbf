"""Speculative decoding: n-gram (prompt lookup), draft-model and self-draft proposers and the
rejection-sampling verification."""
