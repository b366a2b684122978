"""The engine tests' fixtures. torch is imported inside them (through ``helpers``), never at
the top: a conftest that raised Skipped at import would break `pytest tests/engine` at
startup, where each test module's own importorskip skips it cleanly."""

import pytest


@pytest.fixture(scope="session")
def model():
    """The seeded ``TinyLlama`` of ``helpers.CONFIG``, shared by the session."""
    from prefixkv.engine import TinyLlama

    from .helpers import CONFIG

    return TinyLlama(CONFIG)


@pytest.fixture
def make_engine(model):
    """``make_engine(num_blocks, block_size=16, caching=True, allocator=None, **engine_kw)``
    -> (engine, allocator); the runner's cache is poisoned with NaN."""
    from .helpers import make_engine

    return lambda *args, **kw: make_engine(model, *args, **kw)
