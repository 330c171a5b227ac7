"""The replay tests run on both cores of the cache engine (``tests/engine_cores.py``)."""

from tests.engine_cores import engine_core, pytest_generate_tests

__all__ = ["engine_core", "pytest_generate_tests"]
