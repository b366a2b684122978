"""Run vLLM 0.33.0's own tests on vLLM's manager and on prefixkv's, and compare.

The harness (used by tests/engines/test_vllm_suite.py, so by ``make test``):

- ``.cache/engines/`` holds the vllm wheel and the sdist's ``tests/``
  (tests/engines/fetch.py, run by the Makefile); the wheel is installed into the
  project's venv with ``--no-deps`` plus tests/engines/vllm-requirements.txt (the
  pure-Python modules vLLM's scheduler-side code and these tests import, pinned);
- two pytest runs, side by side (one per group of files), run ``FILES`` from vLLM's
  test tree with two modules from this folder: ``vllm_cpu`` (the stand-ins, all listed
  there) and the plugin ``vllm_swap`` (the manager: each test runs as ``[vllm-...]`` on
  vLLM's own manager and as ``[prefixkv-...]`` on prefixkv's scheduler plugin); they are
  processes forked by ``vllm_fork.py`` once it has imported vLLM (see there), and their
  output goes to ``.cache/engines/vllm-suite-<checkout>-<group>.log`` (``default_junit``);
- ``compare`` pairs the two runs of each test.

By hand (from the repository root, after ``make install-vllm``)::

    .venv/bin/python tests/engines/vllm_suite.py      # prints both counts
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
VERSION = "0.33.0"
VLLM_TREE = ROOT / ".cache" / "engines" / f"vllm-{VERSION}"
DOC = ROOT / "docs" / "integration.md"
MANAGERS = ("vllm", "prefixkv")

# vLLM's test files the suite runs: every file of vLLM's tests/ that builds a scheduler or
# a KV cache manager vllm_swap.py swaps and imports on a CPU machine with the modules of
# tests/engines/vllm-requirements.txt. Those that do not, each with why, are
# ``NOT_RUN`` below (docs/integration.md lists them too).
# Two groups, each run in processes of its own (modules of one group set process-wide
# state at import that the other group's tests do not expect): the scheduler's and prefix
# cache's files (tests/v1/core, and the two files elsewhere that build their schedulers
# with tests/v1/core/utils.py), and the KV connectors' (tests/v1/kv_connector/unit).
CORE_FILES = tuple(f"tests/v1/core/{name}.py" for name in (
        "test_scheduler", "test_async_scheduler", "test_prefix_caching",
        "test_deferred_block_free", "test_prefix_replay", "test_priority_preemption_bug",
        "test_swa_inflight_window_free", "test_worker_slot_overflow"))
PREFIX_CACHE_FILES = tuple(f"tests/v1/core/prefix_cache/{name}.py" for name in (
        "test_mamba_eagle_resume_checkpoint", "test_partial_prefix_cache_hits"))
# speculative decoding's dynamic draft length, streaming sessions (resumable requests; its
# unittest.TestCase class runs on both managers too: vllm_swap.pytest_pycollect_makeitem)
SCHEDULER_FILES = ("tests/v1/spec_decode/test_dynamic_sd.py",
                   "tests/v1/streaming_input/test_scheduler_streaming.py")
CONNECTOR_FILES = tuple(f"tests/v1/kv_connector/unit/{name}.py" for name in (
        "test_cache_pollution_prevention", "test_decode_bench_connector", "test_error_propagation",
        "test_invalid_blocks_correctness", "test_kv_load_failure_recovery", "test_lmcache_connector",
        "test_multi_connector", "test_nixl_simple_cpu_offload", "test_remote_decode_lifecycle",
        "test_remote_prefill_lifecycle", "test_scheduler_kv_connector_override",
        "test_simple_cpu_offload_connector", "offloading_connector/test_scheduler"))
FILES = CORE_FILES + PREFIX_CACHE_FILES + SCHEDULER_FILES + CONNECTOR_FILES
FIRST_GROUP = CORE_FILES + PREFIX_CACHE_FILES + SCHEDULER_FILES
"""The files of the first group (the others: the second)."""

# vLLM's test files that build a scheduler or manager and are not run, and why.
NOT_RUN = {
    "tests/v1/core/test_kv_cache_metrics.py": "builds no manager: vLLM's metrics collector on bare blocks",
    "tests/v1/core/test_kv_sharing.py": "builds no manager: a worker helper",
    "tests/v1/core/test_single_type_kv_cache_manager.py": (
        "vLLM's per-group managers on vLLM's BlockPool, built directly: internals the plug-in replaces"),
    "tests/v1/core/prefix_cache/test_partial_prefix_cache_primitives.py": (
        "vLLM's block pool and hashing helpers, built directly"),
    "tests/v1/core/test_contiguous_kv_packing.py": (
        "its passing tests build no manager (vLLM's KV cache grouping and packing helpers); the 3 "
        "that build "
        "one give it a CircularBufferSpec group (2) or SWA bounded replay (SlidingWindowMLASpec) "
        "at a block size below the hash block's (1), refused at construction"),
    "tests/v1/core/test_mamba_align_chunk_split.py": (
        "its passing tests build no manager; the 12 that build one give align-mode Mamba with "
        "speculative blocks (num_speculative_blocks=3, served) lookahead slots "
        "(num_lookahead_tokens=3, with EAGLE or lookahead hashing), refused per call beside Mamba"),
    "tests/v1/engine/test_kv_cache_group_metadata.py": (
        "builds no manager but in its one test of decode context parallelism (dcp_world_size=8), "
        "refused at construction"),
    "tests/v1/simple_kv_offload/test_scheduler.py": (
        "its passing tests bind the connector to a vLLM BlockPool built directly (no manager); "
        "the 18 that build one ask decode context parallelism (dcp_world_size=8), refused at "
        "construction"),
    "tests/v1/simple_kv_offload/test_kv_events.py": "builds no manager: the connector's events",
    "tests/v1/kv_connector/unit/offloading_connector/test_events.py": (
        "builds no manager: the connector's events"),
    "tests/v1/ec_connector/unit/cpu/scheduler/test_scheduler.py": (
        "builds no manager: the encoder-cache connector's scheduler side alone"),
    "tests/v1/kv_connector/unit/test_kv_connector_lifecycle.py": "builds no manager: a worker mixin",
    "tests/v1/kv_connector/unit/test_bidirectional_kv_transfer.py": (
        "imports ray (not installed: a cluster runtime)"),
    "tests/v1/spec_decode/test_dflash_lookahead.py": (
        "needs the config.json of a DFlash draft model (z-lab/Qwen3-8B-DFlash-b16), which the "
        "harness does not write (vllm_cpu.MODELS: public configs of plain checkpoints only)"),
    "tests/v1/core/test_reset_prefix_cache_e2e.py": "LLMEngine loading Qwen3-0.6B's weights",
    "tests/v1/core/prefix_cache/test_hybrid_prefix_cache_hit_rate.py": "a served Qwen3.5-0.8B, and httpx",
    "tests/v1/core/test_priority_scheduler_random.py": (
        "a Qwen2.5-VL-3B scheduler: MultiModalBudget builds the model's processor (tokenizer and "
        "preprocessor files a hub would give) and model inspection imports torchvision"),
}

# Tests whose prefixkv run builds vLLM's own manager, by the start of their ids, and why:
# the swap does not reach them (Comparison.missed), so both runs are vLLM's.
NOT_SWAPPED = {
    "tests/v1/core/test_scheduler.py::test_diffusion_": (
        "vLLM's DiffusionScheduler (create_scheduler's scheduler_cls): prefixkv offers no "
        "diffusion scheduler class"),
    "tests/v1/core/test_scheduler.py::test_sync_diffusion_": (
        "vLLM's DiffusionScheduler (create_scheduler's scheduler_cls): prefixkv offers no "
        "diffusion scheduler class"),
}


@dataclass(frozen=True)
class Comparison:
    """Outcomes of each vLLM test on both managers (test id without the manager)."""

    vllm: dict[str, str]
    prefixkv: dict[str, str]
    prepared_prompts_taken: int = 0
    """Admissions, over the prefixkv runs, that took a Prompt prepared when the request was
    built (vllm_swap.py)."""
    unswapped: frozenset[str] = frozenset()
    """Tests whose prefixkv run built no prefixkv manager (they test vLLM's own parts:
    kv_cache_utils, a BlockPool or coordinator built directly, ...): they say nothing of
    prefixkv's."""
    missed: frozenset[str] = frozenset()
    """Tests whose prefixkv run built vLLM's own manager: a construction the swap
    (vllm_swap.py) did not reach."""

    @property
    def passed_vllm(self) -> set[str]:
        return {t for t, o in self.vllm.items() if o == "passed"}

    @property
    def passed_both(self) -> set[str]:
        return {t for t in self.passed_vllm if self.prefixkv.get(t) == "passed"}

    @property
    def lost(self) -> set[str]:
        """Tests that pass on vLLM's manager and not on prefixkv's."""
        return self.passed_vllm - self.passed_both

    def summary(self) -> str:
        return (f"vLLM {VERSION} tests ({len(self.vllm)} run twice): "
                f"{len(self.passed_vllm)} pass with vLLM's manager, "
                f"{len(self.passed_both)} of them with prefixkv's "
                f"({len(self.passed_both - self.unswapped)} of those built prefixkv's manager); "
                f"{len(self.lost)} do not; {self.prepared_prompts_taken} admissions on prefixkv "
                f"took a prepared Prompt; {len(self.missed)} prefixkv runs built vLLM's manager")


def default_junit(root: pathlib.Path = ROOT) -> pathlib.Path:
    """Where ``run`` writes by default: ``.cache/engines/vllm-suite-<checkout>.xml``
    (``-<group>.xml`` and ``.log`` beside it), named after the checkout ``root`` (its
    folder's name and a digest of its path). Checkouts that share one ``.cache`` (git
    worktrees linking it) run the suite at the same time without writing, and reading,
    each other's files."""
    import hashlib

    where = str(root.resolve()).encode()
    return root / ".cache" / "engines" / f"vllm-suite-{root.name}-{hashlib.sha256(where).hexdigest()[:8]}.xml"


def run(files: tuple[str, ...] = FILES, junit: pathlib.Path | None = None,
        extra: tuple[str, ...] = ()) -> list[pathlib.Path]:
    """Run ``files`` of vLLM's tests on both managers: one pytest run per group of files
    (``FIRST_GROUP``; the connectors'), side by side in processes forked from one that imported vLLM
    (``vllm_fork.py``), each running every test on vLLM's manager and then on prefixkv's
    (vLLM's modules and the test files are imported and collected once for both); returns
    their junit xml files. Raises FileNotFoundError when the fetched tree is missing (run
    the fetch script), RuntimeError with the log's tail when a run wrote no junit file."""
    if not (VLLM_TREE / "tests" / "__init__.py").exists():
        raise FileNotFoundError(f"{VLLM_TREE}/tests is missing: run `make install-vllm` "
                                f"(python tests/engines/fetch.py vllm)")
    base = junit or default_junit()
    first = tuple(f for f in files if f in FIRST_GROUP)
    groups = [g for g in (first, tuple(f for f in files if f not in FIRST_GROUP)) if g]
    env = dict(os.environ, VLLM_SUITE_MANAGERS=",".join(MANAGERS))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(HERE), env.get("PYTHONPATH", "")])
    out, runs = [], []
    for i, group in enumerate(groups):
        xml = base.with_name(f"{base.stem}-{i}.xml")
        # --tb=native: Python's own traceback. pytest's own styles parse the whole
        # source file of every frame (vLLM's test and scheduler files run to thousands
        # of lines) for each failure, which cost more than the tests themselves.
        args = ["-q", "-p", "no:cacheprovider", "-p", "vllm_swap", "--confcutdir=tests/v1", "--tb=native",
                "-o", "junit_family=xunit1", f"--junitxml={xml}", *extra, *group]
        runs.append({"log": str(xml.with_suffix(".log")), "args": args})
        out.append(xml)
    log = base.with_suffix(".log")
    with log.open("w") as f:
        subprocess.run([sys.executable, str(HERE / "vllm_fork.py"), json.dumps(runs)], cwd=VLLM_TREE,
                       env=env, stdout=f, stderr=subprocess.STDOUT)
    missing = [x.name for x in out if not x.exists()]
    if missing:  # the forking process died before its children wrote anything (say, importing vLLM)
        raise RuntimeError(f"no {', '.join(missing)}; {log}:\n{log.read_text()[-3000:]}")
    return out


# pytest puts the manager parameter first: test[vllm], test[vllm-<the test's own ids>].
_ID = re.compile(r"^(?P<base>[^\[]*)\[(?P<manager>vllm|prefixkv)(?:-(?P<params>.*))?\]$")


def outcomes(junit: pathlib.Path) -> dict[tuple[str, str], str]:
    """(test id without the manager, manager) -> passed / failed / error / skipped."""
    out: dict[tuple[str, str], str] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        test = _test_id(case)
        if test is None:
            continue
        kinds = {child.tag for child in case}
        result = ("failed" if "failure" in kinds else "error" if "error" in kinds
                  else "skipped" if "skipped" in kinds else "passed")
        out[test] = result
    return out


def _test_id(case: ET.Element) -> tuple[str, str] | None:
    """(test id without the manager, manager) of a junit testcase; None for one that
    is not a run of vllm_swap's."""
    path = case.get("file") or case.get("classname", "").replace(".", "/") + ".py"
    m = _ID.match(case.get("name", ""))
    if m is None:
        return None
    return f"{path}::{m['base']}" + (f"[{m['params']}]" if m["params"] else ""), m["manager"]


def failures(junit: pathlib.Path) -> dict[str, str]:
    """Test id (without the manager) -> the message of its prefixkv run's failure or
    error (the exception's last line, as junit records it)."""
    out = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        test = _test_id(case)
        if test is not None and test[1] == "prefixkv":
            for child in case:
                if child.tag in ("failure", "error"):
                    out[test[0]] = child.get("message", "")
    return out


def properties(junit: pathlib.Path) -> dict[str, dict[str, int]]:
    """Test id (without the manager) -> the properties its prefixkv run recorded
    (vllm_swap.py: ``prepared_prompts_taken``, ``prefixkv_managers``, ``vllm_managers``)."""
    out: dict[str, dict[str, int]] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        test = _test_id(case)
        if test is not None and test[1] == "prefixkv":
            out[test[0]] = {p.get("name", ""): int(p.get("value", 0)) for p in case.iter("property")}
    return out


def compare(junits: list[pathlib.Path]) -> Comparison:
    res = {k: v for j in junits for k, v in outcomes(j).items()}
    props = {t: p for j in junits for t, p in properties(j).items()}
    return Comparison({t: o for (t, m), o in res.items() if m == "vllm"},
                      {t: o for (t, m), o in res.items() if m == "prefixkv"},
                      sum(p.get("prepared_prompts_taken", 0) for p in props.values()),
                      frozenset(t for t, p in props.items() if not p.get("prefixkv_managers")),
                      frozenset(t for t, p in props.items() if p.get("vllm_managers")))


def documented_differences(doc: pathlib.Path = DOC) -> dict[str, str]:
    """The tests docs/integration.md lists as passing on vLLM's manager and not on
    prefixkv's (its table between the ``vllm-differences`` markers): id -> reason. An id
    without ``[...]`` stands for every parametrization of that test."""
    text = doc.read_text()
    start, end = text.index("<!-- vllm-differences -->"), text.index("<!-- /vllm-differences -->")
    rows = {}
    for line in text[start:end].splitlines():
        m = re.match(r"^\|\s*`([^`]+)`\s*\|\s*(.+?)\s*\|$", line)
        if m:
            rows[m[1]] = m[2]
    return rows


def expand(listed: dict[str, str], tests: set[str]) -> dict[str, set[str]]:
    """Each listed id -> the test ids of ``tests`` it names."""
    return {k: {t for t in tests if t == k or ("[" not in k and t.split("[")[0] == k)}
            for k in listed}


if __name__ == "__main__":
    junits = run(tuple(sys.argv[1:]) or FILES)
    result = compare(junits)
    print(result.summary())
    why = {t: m for j in junits for t, m in failures(j).items()}
    for t in sorted(result.lost):
        print("  lost:", t, result.prefixkv.get(t), why.get(t, "")[:160])
    for t in sorted(result.missed):
        print("  built vLLM's manager on the prefixkv run:", t)
