"""Benchmarks against peers measured in the same run (`jaxgen bench`), written into docs/; the
one-shot GPU suite (`gpu_suite.sh`)."""
