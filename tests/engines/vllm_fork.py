"""The process that runs vLLM's test files for tests/engines/vllm_suite.py: vLLM imported
once, then one forked pytest per group of files.

Each group's pytest used to be a fresh process, and each imported the same vLLM modules
before its first test: configs, scheduler, KV cache manager and request, with torch,
transformers and pydantic under them, some 13 s of CPU every time. This process imports
them once, after ``vllm_cpu`` has configured the process (as ``-p vllm_cpu`` did, before
any vLLM import), and forks a child per group. A child is what the fresh process was:
its own pytest session, plugins (``-p vllm_swap``), conftests and test modules, its
output in its own log; it shares only the modules imported here, copy-on-write. vLLM's
test modules are not imported here: a group's set process-wide state at import that the
other group's tests do not expect.

    python vllm_fork.py '[{"log": "group-0.log", "args": ["-q", ..., "tests/v1/core/..."]}, ...]'

Run from vLLM's fetched tree, with src/ and this folder on PYTHONPATH; exits with the
largest exit status of the children.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import sys


def preload() -> None:
    """Configure the process for vLLM on a CPU, then import what every group imports."""
    importlib.import_module("vllm_cpu")  # configures at import: before any vLLM module
    import vllm.config  # noqa: F401
    import vllm.v1.core.kv_cache_manager  # noqa: F401
    import vllm.v1.core.sched.async_scheduler  # noqa: F401
    import vllm.v1.core.sched.scheduler  # noqa: F401
    import vllm.v1.request  # noqa: F401

    import prefixkv.integrations.vllm.manager  # noqa: F401
    import prefixkv.integrations.vllm.scheduler  # noqa: F401


def run_group(log: str, args: list[str]) -> None:
    """In a forked child: pytest on ``args``, its output into ``log``; never returns."""
    code = 70  # EX_SOFTWARE, should pytest itself raise
    try:
        import pytest

        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        code = int(pytest.main(args))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main(groups: list[dict]) -> int:
    preload()
    import pytest  # noqa: F401  (imported once, for every child)

    # The ~600,000 objects of the preloaded modules live as long as the children: frozen,
    # the children's full collections skip them. Unfrozen, each full collection walked
    # them all (0.4 s each, some 40 per child: 20 s of the core group's 45 s of CPU),
    # and touching their headers copied their pages into every child.
    gc.freeze()

    children = []
    for group in groups:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            run_group(group["log"], group["args"])
        children.append(pid)
    return max(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children)


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
