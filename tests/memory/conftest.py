import pytest


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    """Every module here runs on one thread (tests/conftest.py's one_thread)."""
