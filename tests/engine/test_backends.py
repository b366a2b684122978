"""The engine through the Triton kernels: under the Triton interpreter on the CPU (CI
runs the suite with TRITON_INTERPRET=1), and on a CUDA device when one is present."""

import dataclasses
import os

import pytest

torch = pytest.importorskip("torch", reason="the example engine needs torch")

from prefixkv.engine import LlamaConfig, SamplingParams, build_engine  # noqa: E402
from prefixkv.groups import chunked_local, full_attention, sliding_window  # noqa: E402

SMALL = LlamaConfig(vocab_size=128, hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                    head_dim=32, intermediate_size=64, seed=7)
PROMPTS = [list(range(1, 12)), list(range(1, 10)) + [40, 41, 42, 43], [5] * 17]
PARAMS = SamplingParams(max_tokens=12, n=2, temperature=1.0, seed=1)


HYBRID = {"sliding": (sliding_window(10), full_attention()),
          "chunked": (chunked_local(8), full_attention())}


# The CUDA runs' skip reason: what they add is the device (the compiled kernels). On a CPU the
# same outputs are checked with caching on and off (tests/engine/test_engine.py, torch;
# test_hybrid_engine.py::test_build_engine_with_groups) and Triton's interpreter against
# torch (the tests above).
NO_CUDA = ("needs a CUDA device: the compiled Triton kernels with caching on and off (on a CPU: "
           "test_engine.py and test_hybrid_engine.py compare caching on and off, and this file "
           "the interpreter against torch)")


def outputs(num_blocks, config=SMALL, **kw):
    engine = build_engine(config, num_blocks=num_blocks, block_size=8, **kw)
    result = engine.generate(PROMPTS, PARAMS, on_step=lambda r: engine.allocator.check_invariants())
    return [[s.token_ids for s in o.samples] for o in result.outputs], result


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs TRITON_INTERPRET=1 set before triton is imported")
def test_triton_interpreter_matches_torch_reference():
    pytest.importorskip("triton", reason="triton is not installed")
    want, _ = outputs(64, backend="torch")
    got, result = outputs(10, backend="triton")  # small pool: preemption and forks too
    assert result.num_preemptions > 0
    assert got == want


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_cuda_caching_on_and_off_agree():
    on, res = outputs(10, device="cuda", enable_caching=True)
    off, _ = outputs(10, device="cuda", enable_caching=False)
    assert on == off and res.stats.hits > 0


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs TRITON_INTERPRET=1 set before triton is imported")
@pytest.mark.parametrize("groups", HYBRID.values(), ids=HYBRID)
def test_triton_interpreter_matches_torch_reference_with_layer_groups(groups):
    pytest.importorskip("triton", reason="triton is not installed")
    two = dataclasses.replace(SMALL, num_layers=2)  # layer 0 windowed or chunked, 1 full
    want, _ = outputs(64, two, backend="torch", groups=groups)
    got, result = outputs(12, two, backend="triton", groups=groups)
    assert result.num_preemptions > 0
    assert got == want


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
@pytest.mark.parametrize("groups", HYBRID.values(), ids=HYBRID)
def test_cuda_caching_on_and_off_agree_with_layer_groups(groups):
    two = dataclasses.replace(SMALL, num_layers=2)
    on, res = outputs(12, two, device="cuda", groups=groups, enable_caching=True)
    off, _ = outputs(12, two, device="cuda", groups=groups, enable_caching=False)
    assert on == off and res.stats.hits > 0
