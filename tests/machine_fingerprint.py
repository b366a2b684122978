"""A pytest plug-in for refactoring the state machines: it hashes the pool's state
(``free_block_order()``, ``num_cached_blocks``) after every ``check_invariants`` call of
a run and prints the count and digest at the end, with Hypothesis's example database
off. At one ``--hypothesis-seed`` a refactor that keeps every rule and draw prints the
same line before and after; a rule lost, added or drawing otherwise changes it.

    PYTHONPATH=src:tests python -m pytest -q -s -p machine_fingerprint \\
        --hypothesis-seed=7 tests/test_state_machine.py
"""

import hashlib

from hypothesis import settings

DIGEST = hashlib.sha256()
CALLS = [0]


def _watch(cls):
    real = cls.check_invariants

    def check_invariants(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        DIGEST.update(repr((self.free_block_order(), self.num_cached_blocks)).encode())
        CALLS[0] += 1
        return out
    cls.check_invariants = check_invariants


def pytest_configure(config):
    settings.register_profile("machine_fingerprint", database=None)
    settings.load_profile("machine_fingerprint")
    from prefixkv import KVCacheManager
    from prefixkv.groups import HybridKVCacheManager
    _watch(KVCacheManager)
    _watch(HybridKVCacheManager)


def pytest_unconfigure(config):
    print(f"\nmachine fingerprint: {CALLS[0]} check_invariants calls, {DIGEST.hexdigest()}")
