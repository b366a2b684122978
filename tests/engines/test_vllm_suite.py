"""vLLM 0.33.0's own scheduler and prefix-cache tests, on vLLM's manager and on prefixkv's.

Every test that passes with vLLM's own manager must pass with prefixkv's scheduler
plugin, except those docs/integration.md lists ("With vLLM", the differences table),
one for one. Needs the fetched vLLM tree (``make install-vllm``, which ``make test``
runs); without it this fails, it does not skip.
"""

from __future__ import annotations

import pathlib

import pytest

from . import vllm_suite


def test_checkouts_sharing_the_cache_write_apart(tmp_path: pathlib.Path) -> None:
    """Worktrees link one ``.cache``; each one's suite writes (and reads back) its own
    junit files there, not the same ones."""
    shared = tmp_path / "main" / ".cache"
    (shared / "engines").mkdir(parents=True)
    checkouts = [tmp_path / "main", tmp_path / "wt" / "a", tmp_path / "wt" / "b"]
    for c in checkouts[1:]:
        c.mkdir(parents=True)
        (c / ".cache").symlink_to(shared)
    paths = [vllm_suite.default_junit(c) for c in checkouts]
    assert all(p.parent.resolve() == (shared / "engines").resolve() for p in paths)
    assert len({p.resolve() for p in paths}) == 3
    assert vllm_suite.default_junit(checkouts[1]) == paths[1]  # the same checkout: the same files


@pytest.fixture(scope="module")
def comparison() -> vllm_suite.Comparison:
    return vllm_suite.compare(vllm_suite.run())


def test_vllm_tests_ran_on_both_managers(comparison: vllm_suite.Comparison) -> None:
    print(comparison.summary())
    assert comparison.vllm.keys() == comparison.prefixkv.keys()
    assert len(comparison.passed_vllm) > 200, comparison.summary()
    # most requests of these tests are built once their scheduler exists (vllm_swap.py)
    assert comparison.prepared_prompts_taken > 500, comparison.summary()  # 986 to 1007 on 0.33.0


def test_what_fails_on_prefixkv_is_what_the_docs_list(comparison: vllm_suite.Comparison) -> None:
    listed = vllm_suite.documented_differences()
    named = vllm_suite.expand(listed, set(comparison.vllm))
    assert not [k for k, tests in named.items() if not tests], "listed ids that name no test"
    documented = set().union(*named.values()) if named else set()
    undocumented = sorted(comparison.lost - documented)
    not_lost = sorted(documented - comparison.lost)
    assert not undocumented and not not_lost, (
        f"{comparison.summary()}\nfail on prefixkv, not in the docs: {undocumented}\n"
        f"listed in the docs, not a difference (pass on both, or fail on vLLM's): {not_lost}")


def test_prefixkv_runs_build_prefixkv_managers(comparison: vllm_suite.Comparison) -> None:
    """A prefixkv run that builds vLLM's own manager tests nothing of prefixkv's: only
    those vllm_suite.NOT_SWAPPED names (a class prefixkv does not offer) may."""
    unexplained = sorted(t for t in comparison.missed
                         if not any(t.startswith(p) for p in vllm_suite.NOT_SWAPPED))
    assert not unexplained, f"prefixkv runs that built vLLM's manager: {unexplained}"
    assert len(comparison.passed_both - comparison.unswapped) > 250, comparison.summary()
