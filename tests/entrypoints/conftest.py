"""Fixtures of the entry-point tests: the engine tests' tiny random model."""

from tests.engine.conftest import tiny  # noqa: F401  (a fixture, shared, not copied)
