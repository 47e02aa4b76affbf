"""Fixtures of the entry-point tests: the engine tests' tiny random model."""

from tests.engine.conftest import tiny, tiny_adapters  # noqa: F401  (fixtures, shared, not copied)
