"""Shared builders, inputs and oracles of the tests, each module named by its role (never collected)."""

import pkgutil

import pytest

# Their asserts fail as the tests' own do: pytest rewrites them for its failure messages.
pytest.register_assert_rewrite(*(f"{__name__}.{m.name}" for m in pkgutil.iter_modules(__path__)))
