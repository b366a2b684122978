"""The vLLM plug-in prepares each prompt where vLLM builds its ``Request`` (the engine's
input thread) and admits the ``Prompt`` on the scheduler's thread while it describes the
request exactly; the ids otherwise (prefixkv.integrations.vllm.prepared, .input_thread).

Engine tests run vLLM's own ``EngineCore`` (tests/engines/vllm_engine.py: one stand-in,
the executor). Fallback tests run twins: two prefixkv managers given the same calls, one
on requests built with its preparing hasher, the other on the same requests built
without one (the ids path, as before); each scenario asserts whether the Prompt was
taken, and that both answered alike, hit and block ids. Needs vllm installed."""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixkv import TokenError

from . import skip_module_without_vllm

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
skip_module_without_vllm()
torch = pytest.importorskip("torch")

from .test_vllm_plugin import BS, config, full, window  # noqa: E402
from .vllm_engine import PREFIXKV, build_on_input_thread, engine_core, engine_request  # noqa: E402


def scheduled(engine: Any, requests: list[Any]) -> tuple[dict[str, int], dict[str, int]]:
    """Add ``requests`` to the engine's scheduler and schedule one step: tokens scheduled
    and tokens found computed (cached) per request."""
    for r in requests:
        engine.scheduler.add_request(r)
    out = engine.scheduler.schedule()
    return dict(out.num_scheduled_tokens), {n.req_id: n.num_computed_tokens for n in out.scheduled_new_reqs}


# ---- inside vLLM's EngineCore -------------------------------------------------------------

@pytest.mark.parametrize("scheduler_cls", [PREFIXKV, PREFIXKV.replace("Scheduler", "AsyncScheduler")])
def test_a_served_prompt_is_prepared_on_the_input_thread_and_admitted_without_encoding(
        calling_threads, scheduler_cls):
    import prefixkv.core.prompt as prompt_module
    from prefixkv.integrations.vllm.prepared import PreparingHasher

    engine = engine_core(scheduler_cls)
    m = engine.scheduler.kv_cache_manager
    assert isinstance(engine.request_block_hasher, PreparingHasher)
    assert engine.request_block_hasher.prompts is m.prepared_prompts
    encoded = calling_threads(prompt_module, "encode_tokens")  # a prompt's encoding, wherever admitted
    shared = list(range(1000, 1080))
    sent = [engine_request("a", shared + list(range(20))), engine_request("b", shared + [7] * 20)]
    requests, input_thread = build_on_input_thread(engine, sent)
    assert encoded == [input_thread] * 2 and m.prepared_prompts.prepared == 2
    assert all(len(r.block_hashes) == 6 for r in requests)  # vLLM's own hashes, as before
    del encoded[:]
    steps = scheduled(engine, requests)
    assert encoded == []  # the scheduler's thread encoded nothing: both admitted a Prompt
    assert m.prepared_prompts.taken == 4  # get_computed_blocks and allocate_slots, each

    # the same requests on vLLM's own scheduler: the same step
    theirs = engine_core(None)
    assert not isinstance(theirs.request_block_hasher, PreparingHasher)
    assert scheduled(theirs, build_on_input_thread(theirs, sent)[0]) == steps
    assert steps == ({"a": 100, "b": 20}, {"a": 0, "b": 80})  # b hits what a computes in this step
    # a third request, later: hits the 5 shared blocks, found through its Prompt
    later, _ = build_on_input_thread(engine, [engine_request("c", shared + [9] * 3)])
    tokens, computed = scheduled(engine, later)  # (the async scheduler also decodes a and b)
    assert (tokens["c"], computed) == (3, {"c": 80}) and threading.get_ident() not in encoded


def test_an_engine_without_prefix_caching_gets_no_hasher_and_admits_the_ids(calling_threads):
    import prefixkv.core.prompt as prompt_module

    engine = engine_core(enable_prefix_caching=False)
    assert engine.request_block_hasher is None  # vLLM builds none: nothing to wrap
    encoded = calling_threads(prompt_module, "encode_tokens")
    requests, _ = build_on_input_thread(engine, [engine_request("a", list(range(40)))])
    assert encoded == []
    assert scheduled(engine, requests)[0] == {"a": 40}
    assert encoded == [threading.get_ident()]  # admission (no lookup: caching is off)
    assert engine.scheduler.kv_cache_manager.prepared_prompts.taken == 0


def test_the_hook_judges_each_engine_by_its_own_scheduler():
    import vllm.v1.engine.core as core_module

    from prefixkv.integrations.vllm.input_thread import install

    engine_core()  # installs it
    wrapped = core_module.get_request_block_hasher
    assert install() and core_module.get_request_block_hasher is wrapped  # once per process

    class NotAnEngine:
        scheduler = None

        def hasher(self) -> Any:
            return core_module.get_request_block_hasher(BS, lambda x: b"")

    assert not hasattr(NotAnEngine().hasher(), "prompts")  # vLLM's own hasher


# ---- twins: prepared and ids, side by side ------------------------------------------------

class Twins:
    """Two managers; ``build`` makes each logical request twice (with the preparing
    hasher for ``prepared``, without one for ``ids``); ``admit`` runs vLLM's admission
    calls on both and asserts they answered alike."""

    def __init__(self, *specs: Any, **kw: Any) -> None:
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        from prefixkv.integrations.vllm import KVCacheManager

        init_none_hash(sha256)
        kv_config = config(*(specs or (full(),)), num_blocks=41)
        self.prepared, self.ids = (KVCacheManager(kv_config, max_model_len=8192, scheduler_block_size=BS,
                                                  hash_block_size=BS, **kw) for _ in range(2))
        self.hasher = self.prepared.prepared_prompts.hasher(get_request_block_hasher(BS, sha256))

    def build(self, rid: str, tokens: list[int] | None, **kw: Any) -> tuple[Any, Any]:
        return self.request(rid, tokens, self.hasher, **kw), self.request(rid, tokens, None, **kw)

    @staticmethod
    def request(rid: str, tokens: list[int] | None, hasher: Any, **kw: Any) -> Any:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        return Request(request_id=rid, prompt_token_ids=None if tokens is None else list(tokens),
                       sampling_params=SamplingParams(max_tokens=8), pooling_params=None,
                       block_hasher=hasher, **kw)

    def admit(self, pair: tuple[Any, Any], *, prompt_taken: bool, takes: int = 2) -> tuple[int, list[int]]:
        answers = []
        before = self.prepared.prepared_prompts.taken
        for m, r in zip((self.prepared, self.ids), pair, strict=True):
            blocks, hit, _ = m.get_computed_blocks(r)
            new = m.allocate_slots(r, r.num_tokens - hit, hit, blocks)
            assert new is not None
            answers.append((hit, m.get_block_ids(r.request_id)[0]))
        assert answers[0] == answers[1], answers
        assert self.prepared.prepared_prompts.taken - before == (takes if prompt_taken else 0)
        return answers[0]

    def computed(self, pair: tuple[Any, Any]) -> None:
        """Each twin's request computed its tokens (the scheduler's count), cached."""
        for m, r in zip((self.prepared, self.ids), pair, strict=True):
            r.num_computed_tokens = r.num_tokens
            m.cache_blocks(r, r.num_tokens)

    def cached(self, rid: str, tokens: list[int]) -> None:
        """A request admitted with its Prompt and computed: its full blocks cached."""
        pair = self.build(rid, tokens)
        self.admit(pair, prompt_taken=True)
        self.computed(pair)

    def free(self, pair: tuple[Any, Any], *, preempted: bool = False) -> None:
        for m, r in zip((self.prepared, self.ids), pair, strict=True):
            m.free(r)
            if preempted:
                r.num_computed_tokens = 0
                r.num_preemptions += 1


def test_a_fresh_request_and_one_preempted_before_any_output_admit_the_prompt():
    t = Twins()
    a = t.build("a", list(range(40)))
    assert t.admit(a, prompt_taken=True) == (0, [1, 2, 3])
    t.computed(a)
    t.free(a, preempted=True)
    assert t.admit(a, prompt_taken=True) == (32, [1, 2, 3])  # resumed: its own two blocks hit


def test_outputs_appended_admit_the_ids():
    # a request preempted after decoding re-admits prompt + outputs: 50 tokens, not 40
    t = Twins()
    a = t.build("a", list(range(40)))
    t.admit(a, prompt_taken=True)
    for r in a:
        r.append_output_token_ids(list(range(500, 510)))
    t.computed(a)
    t.free(a, preempted=True)
    assert t.admit(a, prompt_taken=False) == (48, [1, 2, 3, 4])


def test_a_prompt_cut_by_a_connector_and_grown_back_by_an_output_admits_the_ids():
    # Mooncake/MoRIIO's prefill side pops the prompt's last token; an output then brings
    # the count back to the prepared one, with another token at the end
    t = Twins()
    a = t.build("a", list(range(32)))
    for r in a:
        r.prompt_token_ids.pop()
        r._all_token_ids.pop()
        r.num_prompt_tokens -= 1
    assert t.admit(a, prompt_taken=False)[0] == 0
    t.free(a)
    for r in a:
        r.append_output_token_ids(777)
    t.free(a, preempted=True)
    b = t.build("b", [*range(31), 777, 5])
    assert t.admit(a, prompt_taken=False) == (16, [1, 2])  # [0, 16) was cached before the output
    t.computed(a)
    assert t.admit(b, prompt_taken=True) == (32, [1, 2, 3])  # a's blocks hold 777, not 31


def test_a_replaced_token_list_of_the_same_length_admits_the_ids():
    # as vLLM's test_async_scheduler builds next turns: a new list, same count
    from vllm.v1.utils import ConstantList

    t = Twins()
    t.cached("seed", [9] * 32)
    a = t.build("a", list(range(32)))
    for r in a:
        r._all_token_ids = [9] * 32
        r.all_token_ids = ConstantList(r._all_token_ids)
    assert t.admit(a, prompt_taken=False)[0] == 16  # hits seed's first block (31 max)


def test_a_streaming_session_admits_the_ids():
    t = Twins()
    a = t.build("a", list(range(20)), resumable=True)
    assert t.admit(a, prompt_taken=False)[0] == 0


@pytest.mark.parametrize("change", ["cache_salt", "lora_request", "mm_features", "prompt_embeds"])
def test_extra_inputs_replaced_after_preparing_admit_the_ids(change):
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    t = Twins()
    t.cached("base", list(range(40)))
    a = t.build("a", list(range(40)))
    for r in a:
        if change == "cache_salt":
            r.cache_salt = "tenant"
        elif change == "lora_request":
            r.lora_request = LoRARequest("adapter", 1, "/a")
        elif change == "mm_features":
            r.mm_features.append(MultiModalFeatureSpec(None, "image", "img", PlaceholderRange(2, 4)))
        else:
            r.prompt_embeds = torch.ones(40, 2)
    assert t.admit(a, prompt_taken=False)[0] == 0  # the new input enters the identity: no hit


def test_prompts_with_extra_inputs_are_prepared_with_them():
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    t = Twins()
    image = [MultiModalFeatureSpec(None, "image", "img-1", PlaceholderRange(offset=18, length=4))]
    kinds = {"salt": {"cache_salt": "tenant"}, "lora": {"lora_request": LoRARequest("adapter", 1, "/a")},
             "mm": {"mm_features": image}}
    for name, kw in kinds.items():
        first = t.build(f"{name}-1", list(range(40)), **kw)
        assert t.admit(first, prompt_taken=True)[0] == 0  # a miss: plain blocks do not match
        t.computed(first)
        again = t.build(f"{name}-2", list(range(40)), **kw)
        assert t.admit(again, prompt_taken=True)[0] == 32
    embeds = torch.arange(80.0).reshape(40, 2)
    e1 = t.build("e1", None, prompt_embeds=embeds)
    assert t.admit(e1, prompt_taken=True)[0] == 0
    t.computed(e1)
    assert t.admit(t.build("e2", None, prompt_embeds=embeds.clone()), prompt_taken=True)[0] == 32
    assert t.admit(t.build("e3", None, prompt_embeds=embeds + 1), prompt_taken=True)[0] == 0


def test_mixed_prompts_with_the_same_ids_and_embeds_but_another_mask_do_not_share():
    # A chat prompt mixing token ids and prompt_embeds (vLLM's ``prompt_is_token_ids``):
    # embedded positions carry id 0 and the full-length embeds tensor zeros at token
    # positions. So a real token 0 beside an embedded span reads, in ids and embeds, the
    # same as one more embedded row of zeros: only the mask tells the model which input
    # it ran on, and two such prompts computed different KV.
    tokens = list(range(1, 41))
    tokens[20] = 0
    embeds = torch.zeros(40, 2)
    embeds[10:20] = torch.arange(20.0).reshape(10, 2) + 1

    def mask(embedded: range) -> list[bool]:
        return [i not in embedded for i in range(40)]

    t = Twins()
    a = t.build("a", tokens, prompt_embeds=embeds, prompt_is_token_ids=mask(range(10, 20)))
    assert t.admit(a, prompt_taken=True)[0] == 0
    t.computed(a)
    again = t.build("a2", tokens, prompt_embeds=embeds.clone(), prompt_is_token_ids=mask(range(10, 20)))
    assert t.admit(again, prompt_taken=True)[0] == 32
    b = t.build("b", tokens, prompt_embeds=embeds.clone(), prompt_is_token_ids=mask(range(10, 21)))
    assert [list(r.all_token_ids) for r in b] == [list(a[0].all_token_ids)] * 2  # the same ids
    assert t.admit(b, prompt_taken=True)[0] == 16  # position 20: token 0 in a, zeros in b (block 1)


def test_a_prompt_prepare_refuses_still_builds_and_is_refused_at_admission_as_before():
    t = Twins()
    a = t.build("a", [1, 2, -3])  # prefixkv takes ids in [0, 2**32)
    assert t.prepared.prepared_prompts.prepared == 0
    for m, r in zip((t.prepared, t.ids), a, strict=True):
        with pytest.raises(TokenError):
            m.get_computed_blocks(r)


def test_a_request_prepared_for_another_manager_admits_the_ids():
    t, other = Twins(), Twins()
    a = (other.request("a", list(range(40)), other.hasher), t.request("a", list(range(40)), None))
    assert other.prepared.prepared_prompts.prepared == 1
    assert t.admit(a, prompt_taken=False) == (0, [1, 2, 3])


def test_a_request_that_skips_reading_the_cache_admits_its_prompt_without_a_hit():
    from vllm.sampling_params import SamplingParams

    t = Twins()
    t.cached("base", list(range(40)))
    a = t.build("a", list(range(40)))
    for r in a:
        r.sampling_params = SamplingParams(max_tokens=8, prompt_logprobs=1)
        r.skip_reading_prefix_cache = True
    assert t.admit(a, prompt_taken=True, takes=1)[0] == 0  # no lookup: one take, at admission


@pytest.mark.parametrize("hybrid", [False, True])
def test_events_of_prepared_prompts_are_those_of_the_ids(hybrid):
    # the hybrid manager hashes a prompt's blocks in prepare when events are on: on the
    # input thread, the same chain hashes as at admission
    t = Twins(*((full(), window()) if hybrid else ()), enable_kv_cache_events=True)
    a = t.build("a", list(range(80)))
    t.admit(a, prompt_taken=True)
    t.computed(a)
    assert t.admit(t.build("b", [*range(80), 3]), prompt_taken=True)[0] == 80
    events = [m.take_events() for m in (t.prepared, t.ids)]
    assert events[0] == events[1] and len(events[0]) >= 1
    assert (t.prepared.core.prepare(list(range(80))).block_hashes is not None) == hybrid


OPS = ("admit", "compute", "output", "preempt", "cut", "salt")


def _step(t: Twins, pair: tuple[Any, Any], op: str, k: int) -> None:
    """One of ``OPS`` on both twins' request (when it applies to the request's state)."""
    live = t.prepared.key_of(pair[0].request_id) is not None
    if op == "admit" and not live:
        answers = []
        for m, r in zip((t.prepared, t.ids), pair, strict=True):
            blocks, hit, _ = m.get_computed_blocks(r)
            new = m.allocate_slots(r, r.num_tokens - hit, hit, blocks)
            answers.append((hit, None if new is None else m.get_block_ids(r.request_id)))
        assert answers[0] == answers[1], answers
    elif op == "compute" and live:
        t.computed(pair)
    elif op == "output" and live:
        for r in pair:
            r.append_output_token_ids(100 + k)
    elif op == "preempt" and live:
        t.free(pair, preempted=True)
    elif op == "cut" and not live and not pair[0].num_output_tokens and pair[0].num_tokens > 1:
        for r in pair:  # a P/D connector's prefill side
            r.prompt_token_ids.pop()
            r._all_token_ids.pop()
            r.num_prompt_tokens -= 1
    elif op == "salt" and not live:
        for r in pair:
            r.cache_salt = f"tenant-{k}"


@settings(max_examples=60, deadline=None)
@given(prompts=st.lists(st.sampled_from([15, 16, 17, 31, 32, 33, 48]), min_size=2, max_size=3),
       ops=st.lists(st.tuples(st.integers(0, 3), st.sampled_from(OPS), st.integers(0, 3)), max_size=30))
def test_twins_answer_alike_whatever_happens_to_their_requests(prompts, ops):
    # prompts share their first tokens (0, 1, 2, ...), so hits come and go with the ops;
    # the events say what each stored block holds (its chain hash, its tokens)
    t = Twins(enable_kv_cache_events=True)
    pairs = [t.build(f"r{i}", list(range(n))) for i, n in enumerate(prompts)]
    for i, op, k in [*ops, *((i, "admit", 0) for i in range(len(pairs)))]:
        _step(t, pairs[i % len(pairs)], op, k)
        events = [m.take_events() for m in (t.prepared, t.ids)]
        assert events[0] == events[1], (op, events)
    for m in (t.prepared, t.ids):
        m.core.check_invariants()
