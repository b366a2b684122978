"""tests/engines/vllm_cpu.py's local hub cache, written while other processes read it."""

from __future__ import annotations

import json
import pathlib
import threading

import pytest

from . import vllm_cpu


def _files(home: pathlib.Path) -> dict[pathlib.Path, tuple[int, int]]:
    return {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in sorted(home.rglob("*")) if p.is_file()}


def test_a_second_write_leaves_the_cache_as_it_was(tmp_path: pathlib.Path) -> None:
    """Every process importing vllm_cpu writes the cache that worktrees share: one already
    written is not touched again (it was rewritten in place each time)."""
    vllm_cpu.write_hub_cache(tmp_path)
    before = _files(tmp_path)
    assert len(before) == 2 * len(vllm_cpu.MODELS)
    vllm_cpu.write_hub_cache(tmp_path)
    assert _files(tmp_path) == before


def test_a_reader_never_sees_a_file_half_written(tmp_path: pathlib.Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """While the cache is rewritten with other contents, a reader of ``refs/main`` and
    ``config.json`` (as vLLM's ``ModelConfig`` reads them) always finds a whole file, the
    old or the new (truncated in place, it found empty ones: vLLM raised "Invalid
    repository ID 'facebook/opt-125m'", test_vllm_suite's flake under load)."""
    name = "facebook/opt-125m"
    one = {name: vllm_cpu.MODELS[name]}
    two = {name: {**vllm_cpu.MODELS[name], "hidden_size": 1024}}
    monkeypatch.setattr(vllm_cpu, "MODELS", one)
    vllm_cpu.write_hub_cache(tmp_path)
    repo = tmp_path / "hub" / "models--facebook--opt-125m"
    config = repo / "snapshots" / vllm_cpu.REVISION / "config.json"
    seen: list[str] = []
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            ref = (repo / "refs" / "main").read_text()
            text = config.read_text()
            if ref != vllm_cpu.REVISION or not text or json.loads(text) not in (one[name], two[name]):
                seen.append(f"refs/main {ref!r}, config.json {text[:40]!r}")

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(400):
            monkeypatch.setattr(vllm_cpu, "MODELS", (one, two)[i % 2])
            vllm_cpu.write_hub_cache(tmp_path)
    finally:
        done.set()
        reader.join()
    assert not seen, seen[:3]
    assert not [p for p in repo.rglob(".*") if p.is_file()], "temporary files left behind"
