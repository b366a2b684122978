"""Tenants under the state machine of ``test_state_machine``: requests whose keys are
built to collide once encoded (a salt with a NUL, a salt that spells the next tag, a
LoRA name that spells a salt, NFC and NFD spellings of one accented name, a salt equal
to a LoRA name) share prompts, are forked, preempted and re-admitted, evicted to a host
tier and loaded back, under a hash where every block collides or one blind to the parent.
The simulated KV store checks after every step that each live request's blocks hold
what its own tokens and keys would have produced, so a block of another tenant served
as a hit is caught at the step it happens."""

import hashlib

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import rule

from prefixkv import ExtraKeys
from test_state_machine import PREFIXES, ManagerMachine, prompts

NFC, NFD = "caf\u00e9", "cafe\u0301"  # one name, two code point sequences

TENANT_KEYS = [
    None,
    ExtraKeys(cache_salt="a"),
    ExtraKeys(cache_salt="a\x00"),
    ExtraKeys(cache_salt="a" + "L\x00\x00\x00\x00"),  # spells an empty LoRA tag after "a"
    ExtraKeys(lora="a"),
    ExtraKeys(lora="x", cache_salt="y"),
    ExtraKeys(lora="x" + "S\x01\x00\x00\x00y"),  # spells (lora "x", salt "y") in one name
    ExtraKeys(cache_salt=NFC),
    ExtraKeys(cache_salt=NFD),
    ExtraKeys(lora=NFC, cache_salt=NFD),
]
tenants = st.sampled_from(TENANT_KEYS)


class TenantMixin(ManagerMachine):
    """Adds admissions under the adversarial keys above (the base machine's own rules
    admit under None, salt "a" and LoRA "a")."""

    @rule(prompt=prompts, extra=tenants, chunk=st.none() | st.integers(1, 6))
    def add_tenant(self, prompt, extra, chunk):
        self._admit(prompt, extra, chunk)

    @rule(pre=st.integers(0, len(PREFIXES) - 1), tail=st.integers(0, 6), extra=tenants)
    def add_tenant_known_prefix(self, pre, tail, extra):
        self._admit(PREFIXES[pre] + [0] * tail, extra, None)

    @rule(pre=st.integers(0, len(PREFIXES) - 1), first=tenants, second=tenants)
    def two_tenants_one_prompt(self, pre, first, second):
        """The same prompt under two key sets, back to back (the KV check after the
        step catches a hit on the first one's blocks under other keys)."""
        prompt = PREFIXES[pre] + [1]
        self._admit(prompt, first, None)
        self._admit(prompt, second, None)


def _bucket4(data: bytes) -> bytes:
    return bytes([hashlib.sha256(data).digest()[0] % 4])


def _parent_blind(data: bytes) -> bytes:
    return hashlib.sha256(data[16:]).digest()[:16]


class CollidingHostTierTenantMachine(TenantMixin):
    """Four hash buckets, a host tier: evicted blocks of every tenant meet in the tier."""

    hash_mode = staticmethod(_bucket4)
    exact_hash = False
    host_blocks = 6
    num_blocks = 7


class ParentBlindTenantMachine(TenantMixin):
    """A hash blind to the parent digest, no events (the index's fast paths)."""

    hash_mode = staticmethod(_parent_blind)
    exact_hash = False
    events = False


class Sha256HostChainTenantMachine(TenantMixin):
    """sha256, a tier twice the pool without events (chained slots, batch demotes)."""

    hash_mode = "sha256"
    host_blocks = 12
    events = False


for _machine in (CollidingHostTierTenantMachine, ParentBlindTenantMachine,
                 Sha256HostChainTenantMachine):
    _machine.TestCase.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)

TestCollidingHostTierTenants = CollidingHostTierTenantMachine.TestCase
TestParentBlindTenants = ParentBlindTenantMachine.TestCase
TestSha256HostChainTenants = Sha256HostChainTenantMachine.TestCase
