"""The model runner: jitted prefill/decode/paged steps and the ahead-of-time compiled buckets."""
