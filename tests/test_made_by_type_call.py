"""The ``Admission`` and the ``PendingEvents`` a step makes are made with no ``__init__``
of Python run and no argument tuple parsed (a class whose ``__init__`` is the C slot
``object.__init__``, called with no argument: ``type_call``, ``object_new``,
``object_init``, the paths the step runs for its ``Request``; benchmarks/results/
events-r23.md), each an instance of the public class in every other way: equal, hashed,
shown and read as one made by the public constructor, and handled so by the publisher."""

from __future__ import annotations

import pickle

from prefixkv import Admission, KVCacheManager
from prefixkv.event_log import PendingEvents
from prefixkv.fleet.publisher import EventPublisher


def _made_by_type_call(obj: object) -> bool:
    return type(obj).__init__ is object.__init__ and type(obj).__new__ is object.__new__


def test_a_steps_admission_and_batch_are_made_by_type_call() -> None:
    m = KVCacheManager(64, 4, seed=0, enable_events=True)
    adm = m.add_request("a", m.prepare(list(range(1, 23))))
    batch = m.take_pending_events()
    assert _made_by_type_call(adm) and _made_by_type_call(batch)
    assert isinstance(adm, Admission) and isinstance(batch, PendingEvents)
    assert not _made_by_type_call(Admission("a", [0], 0, 1))  # (the public constructor)


def test_the_admission_is_one_as_the_public_constructor_makes() -> None:
    m = KVCacheManager(64, 4, seed=0)
    adm = m.add_request("a", m.prepare(list(range(1, 23))))
    same = Admission("a", [0, 1, 2, 3, 4, 5], 0, 22)
    assert adm == same and same == adm and hash(adm) == hash(same)
    assert repr(adm) == repr(same) == ("Admission(request_id='a', block_ids=(0, 1, 2, 3, 4, 5), "
                                       "num_cached_tokens=0, num_new_tokens=22)")
    assert adm.group_block_ids == ((0, 1, 2, 3, 4, 5),)
    assert pickle.loads(pickle.dumps(adm)) == same


def test_the_batch_builds_and_publishes_as_a_pending_events() -> None:
    m = KVCacheManager(64, 4, seed=0, enable_events=True)
    m.add_request("a", m.prepare(list(range(1, 23))))
    batch = m.take_pending_events()
    assert not batch.empty and not batch.is_built
    pub = EventPublisher(block_size=4, heartbeat=None)
    try:
        assert pub.publish(batch) is True
    finally:
        pub.close(timeout=30)
    assert pub.health()["published_batches"] == 1
    assert [type(e).__name__ for e in batch.build()] == ["BlockStored"]
