"""prefixkv's manager beside SGLang 0.5.23's own ``RadixCache`` (from the wheel; the
stand-ins it needs are listed in ``sglang_radix.py``), driven by one random request stream
(Hypothesis) as each engine's scheduler drives its cache: admission (hit, then the prompt
computed, at once or in chunks), decode steps, finish (or an abort mid-prefill), and a
cache flush; page size 1 and > 1.

What each serves is checked against a model of what each caches, on pools that never
evict: SGLang keys its tree when a prefill ends and when a request finishes (its
``checkpoint``: the computed tokens, page-aligned); prefixkv caches a block as soon as
it is full, decoded tokens included. So prefixkv's hit is never shorter than SGLang's, and
is equal unless the longer part was decoded by a request still running (SGLang keys it
only at finish). Both leave one prompt token to compute and round down to a page.

Multimodal inputs: SGLang pads an image's placeholder positions with values derived from
its hash (``pad_input_ids``), so its tree sees them as tokens; prefixkv keeps the
placeholder ids and carries the image as an extra key of each block it overlaps. LoRA is
SGLang's ``extra_key`` and prefixkv's ``ExtraKeys.lora``; the salt is ``cache_salt`` in
both."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from prefixkv import ExtraKeys, KVCacheManager, MultiModalInput

from .sglang_radix import Radix

PLACEHOLDER = 9  # the prompt's token id at an image's positions
IMAGES = {"cat": 3, "dog": 5}  # image id -> placeholder length (fixed by the image)


def _pad(image: str, i: int) -> int:
    """SGLang's pad value at position ``i`` of ``image`` (a stand-in for its hash-derived
    pad values: distinct per image, never a text token id)."""
    return 1_000_000 + 1000 * sorted(IMAGES).index(image) + i


@dataclass
class Prompt:
    tokens: list[int]  # prefixkv's (placeholders)
    view: list[int]  # SGLang's (padded)
    lora: str | None
    salt: str | None
    images: tuple[tuple[str, int], ...]  # (image, offset)

    def extra(self) -> ExtraKeys | None:
        mm = tuple(MultiModalInput(im, off, IMAGES[im]) for im, off in self.images)
        if self.lora is None and self.salt is None and not mm:
            return None
        return ExtraKeys(lora=self.lora, cache_salt=self.salt, mm=mm)


@st.composite
def prompts(draw: st.DrawFn) -> Prompt:
    family = draw(st.integers(0, 2))
    tokens = [100 * family + k for k in range(draw(st.integers(0, 20)))]
    tokens += draw(st.lists(st.integers(0, 3), max_size=8))
    images = []
    if draw(st.integers(0, 3)) == 0:  # an image somewhere in the prompt
        im, off = draw(st.sampled_from(sorted(IMAGES))), draw(st.integers(0, len(tokens)))
        tokens[off:off] = [PLACEHOLDER] * IMAGES[im]
        images.append((im, off))
    tokens = tokens or [7]
    view = list(tokens)
    for im, off in images:
        view[off:off + IMAGES[im]] = [_pad(im, i) for i in range(IMAGES[im])]
    return Prompt(tokens, view, draw(st.sampled_from([None, None, "adapter"])),
                  draw(st.sampled_from([None, None, "tenant"])), tuple(images))


OP = st.tuples(st.sampled_from(["admit", "admit", "turn", "decode", "decode", "finish", "reset"]),
               st.integers(0, 3), st.integers(1, 7), prompts())


@dataclass
class Model:
    """What each side has keyed: (lora, salt, model-view tokens up to a page end)."""

    P: int
    ours: set[tuple] = field(default_factory=set)
    theirs: set[tuple] = field(default_factory=set)

    def key(self, p: Prompt, view: list[int], n: int) -> tuple:
        return (p.lora, p.salt, tuple(view[:n]))

    def add(self, into: set[tuple], p: Prompt, view: list[int], n: int) -> None:
        into.update(self.key(p, view, j * self.P) for j in range(1, n // self.P + 1))

    def hit(self, have: set[tuple], p: Prompt) -> int:
        j = (len(p.view) - 1) // self.P
        while j and self.key(p, p.view, j * self.P) not in have:
            j -= 1
        return j * self.P


@settings(max_examples=40, deadline=None)
@given(page_size=st.sampled_from([1, 1, 2, 4]), ops=st.lists(OP, min_size=10, max_size=40))
def test_prefixkv_hits_what_sglangs_radix_cache_hits_and_what_it_decoded(page_size, ops):
    # pools that never evict: 40 ops of at most 43 tokens each (3 x 20 + 8 + 5 + 7 x 40)
    P, pages = page_size, 4000 // page_size
    ours, theirs = KVCacheManager(pages, P), Radix(pages, P)
    model = Model(P)
    live: dict[int, tuple[str, Prompt, list[int]]] = {}  # slot -> (rid, prompt, decoded)
    turns: list[tuple[Prompt, list[int]]] = []  # every request so far: its prompt, decoded
    done: dict[str, list[int]] = {}  # prompt tokens computed so far, ours and theirs
    for serial, (op, slot, k, prompt) in enumerate(ops):
        if op == "turn" and turns and slot not in live:  # the next turn of a chat
            p, decoded = turns[k % len(turns)]
            suffix = prompt.tokens[-(k % 4 + 1):]
            prompt = Prompt(p.tokens + decoded + suffix, p.view + decoded + suffix, p.lora, p.salt,
                            p.images)
            op = "admit"
        if op == "admit" and slot not in live:
            rid = f"r{serial}"
            chunk = k if k % 2 else None  # (odd k: a chunked prefill of k tokens first)
            mine = ours.add_request(rid, prompt.tokens, extra=prompt.extra(), num_new_tokens=chunk)
            hit = theirs.admit(rid, prompt.view, prompt.lora, prompt.salt, chunk)
            assert mine is not None and hit is not None
            want = (model.hit(model.ours, prompt), model.hit(model.theirs, prompt))
            assert (mine.num_cached_tokens, hit) == want, (mine.num_cached_tokens, hit, want, prompt)
            assert mine.num_cached_tokens >= hit
            n = len(prompt.view) - hit if chunk is None else min(chunk, len(prompt.view) - hit)
            done[rid] = [mine.num_cached_tokens + mine.num_new_tokens, hit + n]  # (ours, theirs)
            for into, d in zip((model.ours, model.theirs), done[rid], strict=True):
                model.add(into, prompt, prompt.view, d)  # each prefill chunk's end keys it
            live[slot] = (rid, prompt, [])
            turns.append((prompt, live[slot][2]))
        elif op == "decode" and slot in live and min(done[live[slot][0]]) < len(live[slot][1].view):
            rid, prompt, _ = live[slot]  # the next chunk of a chunked prefill (on a side
            left = [len(prompt.view) - d for d in done[rid]]  # whose hit was shorter: more)
            if left[0]:
                assert ours.extend(rid, min(k, left[0])) is not None
            if left[1]:
                assert theirs.extend(rid, min(k, left[1]))
            done[rid] = [d + min(k, n) for d, n in zip(done[rid], left, strict=True)]
            for into, d in zip((model.ours, model.theirs), done[rid], strict=True):
                model.add(into, prompt, prompt.view, d)
        elif op == "decode" and slot in live:
            rid, prompt, decoded = live[slot]
            for i in range(k):
                t = (serial + i) % 4  # (a later prompt may continue it)
                assert ours.append_tokens(rid, [t]) is not None and theirs.decode(rid, t)
                decoded.append(t)
            model.add(model.ours, prompt, prompt.view + decoded, len(prompt.view) + len(decoded))
        elif op == "finish" and slot in live:  # (or aborted mid-prefill: its chunks stay keyed)
            rid, prompt, decoded = live.pop(slot)
            ours.free(rid)
            theirs.finish(rid)
            computed = prompt.view[:done[rid][1]] + decoded
            model.add(model.theirs, prompt, computed, len(computed))
        elif op == "reset":
            assert ours.reset_prefix_cache() == theirs.reset() == (not live)
            if not live:
                model.ours.clear()
                model.theirs.clear()
        ours.check_invariants()
