"""A Python interpreter that has imported torch and triton once, and forks a child for
each command it is given: the interpreter that tests hand to the scripts and examples
they run end to end (``benchmarks/gpu_session.sh --smoke``, ``examples/fleet.py``,
``examples/shared_store.py``).

Each of those starts several Python processes, and each process imported torch and
triton before doing anything (about 3.5 s of CPU each on the 2-core VM: ~8 processes
in the GPU-session smoke, 7 in the fleet example). Here one server process imports
them; a command is then a fork of it, as tests/engines/vllm_fork.py forks vLLM's test
runs from one process that imported vLLM:

    client (argv, cwd, environment, open fds) --unix socket--> server --fork--> child

``client`` is what the scripts run as ``python`` (the fixture ``warm_python`` in
tests/conftest.py writes a two-line wrapper that starts it with ``-S -E``: no site, no
torch). It sends its command line, working directory, umask, environment, the signals
it ignores and every open file descriptor (SCM_RIGHTS) to the server and waits; the
child puts the descriptors back at their numbers, takes the rest and ``PYTHONPATH``
(in front of the server's own site path), sets ``sys.executable`` to the client (so that
the processes it starts, ``multiprocessing`` spawn included, are forks too) and runs the
command as ``python`` would: ``-c CODE``, ``-m MODULE``, ``-`` (stdin) or a script, with
the same exit status, uncaught exceptions printed the same way, atexit handlers and
non-daemon threads finished at exit. Signals the client receives go to the child;
when the client dies (SIGKILL included), the server kills the child's process group.

What differs from a fresh interpreter: the modules imported at start are already in
``sys.modules``; ``sys.flags`` and resource limits are the server's; the child leads a
session of its own (no controlling terminal). Where the imports could differ the client
runs the real interpreter instead (``exec``, nothing forked): any interpreter option but
``-B``, or a variable read when those modules or the interpreter start (``TRITON_*``,
``TORCH*``, ``OMP_*``, ``CUDA_*``, ``LD_*``, the locale's, Python's own start-up
variables but ``PYTHONPATH``, ``PYTHONUNBUFFERED`` and ``PYTHONDONTWRITEBYTECODE``, which
the child applies) set otherwise than the server's, or a ``PYTHONPATH`` whose
``sitecustomize`` (run once, in the server) is another.

This module is the client and what both sides share; the server and the child are in
tests/warm_server.py.

    python tests/warm_python.py serve SOCKET PARENT_PID   # "ready" once torch is imported
    python -S -E tests/warm_python.py client SOCKET PYTHON WRAPPER ARGS...
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
from typing import Any

PRELOAD = ("torch", "triton", "triton.language")
_PINNED = ("TRITON", "TORCH", "PYTORCH", "OMP_", "MKL_", "CUDA_", "LD_", "LC_", "LANG")
# read by the interpreter as it starts (PYTHONPATH, PYTHONUNBUFFERED and
# PYTHONDONTWRITEBYTECODE the child applies itself)
_STARTUP = frozenset(f"PYTHON{v}" for v in (
    "HOME", "HASHSEED", "WARNINGS", "OPTIMIZE", "SAFEPATH", "NOUSERSITE", "IOENCODING", "UTF8",
    "DEVMODE", "MALLOC", "FAULTHANDLER", "TRACEMALLOC", "VERBOSE", "INTMAXSTRDIGITS",
    "PLATLIBDIR", "USERBASE", "PYCACHEPREFIX", "NODEBUGRANGES", "COERCECLOCALE",
    "WARNDEFAULTENCODING", "INSPECT", "DEBUG", "CASEOK", "EXECUTABLE", "PROFILEIMPORTTIME"))
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
              signal.SIGUSR2)
MAX_FDS = 250  # SCM_RIGHTS takes at most 253 descriptors per message


def supported() -> bool:
    """Whether this machine can run the server: Linux (/proc, PR_SET_PDEATHSIG), pidfds,
    descriptors passed over a Unix socket."""
    return (sys.platform == "linux" and hasattr(os, "pidfd_open") and hasattr(socket, "send_fds")
            and os.path.isdir("/proc/self/fd"))


def pinned(env: dict[str, str]) -> dict[str, str | None]:
    """What a child must share with the server: the variables read when the interpreter
    or the preloaded modules started, and the ``sitecustomize`` that ``PYTHONPATH`` gives
    (it ran once, in the server)."""
    out: dict[str, str | None] = {k: v for k, v in env.items()
                                  if k.startswith(_PINNED) or k in _STARTUP}
    out["sitecustomize"] = next((p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                 if p and os.path.exists(os.path.join(p, "sitecustomize.py"))),
                                None)
    return out


def runnable(args: list[str]) -> bool:
    """Whether the child can run ``python *args``: the forms scripts use, after any ``-B``
    (which multiprocessing passes on); any other interpreter option goes to the real
    interpreter."""
    args = without_b(args)
    return bool(args) and (args[0] in ("-c", "-m") and len(args) > 1 or args[0] == "-"
                           or not args[0].startswith("-"))


def without_b(args: list[str]) -> list[str]:
    while args[:1] == ["-B"]:
        args = args[1:]
    return args

# ---- client ------------------------------------------------------------------------------


def client(path: str, python: str, executable: str, args: list[str]) -> None:
    """Run ``python *args`` in a fork of the server at ``path``, whose ``sys.executable`` is
    ``executable`` (the wrapper that started this client); exit as the child did.
    The real interpreter runs it (exec) when the server cannot: no server, an option it
    does not take, a pinned variable set otherwise."""
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.connect(path)
    except OSError:
        os.execv(python, [python, *args])
    ignored = [s for s in FORWARDED if signal.getsignal(s) == signal.SIG_IGN]  # inherited
    # forwarded to the child; one that comes before the child's pid waits for it
    state: dict[str, Any] = {"pid": None, "pending": []}

    def forward(sig: int, _frame: object) -> None:
        if state["pid"] is None:
            state["pending"].append(sig)
        else:
            os.kill(state["pid"], sig)

    for sig in set(FORWARDED) - set(ignored):
        signal.signal(sig, forward)
    fds = sorted(int(n) for n in os.listdir("/proc/self/fd"))
    fds = [fd for fd in fds if fd != sock.fileno() and _is_open(fd)][:MAX_FDS]
    umask = os.umask(0o22)
    os.umask(umask)
    request = {"args": args, "cwd": os.getcwd(), "env": dict(os.environ), "executable": executable,
               "ignored": [int(s) for s in ignored], "umask": umask,
               "fds": [[fd, os.get_inheritable(fd)] for fd in fds]}
    payload = json.dumps(request).encode()
    socket.send_fds(sock, [len(payload).to_bytes(8, "little") + payload], fds)
    replies = sock.makefile("r")
    first = replies.readline().split()
    if first[:1] != ["pid"]:  # the server declined: the real interpreter, as if run at once
        sock.close()
        for sig in state["pending"]:
            signal.signal(sig, signal.SIG_DFL)
            os.kill(os.getpid(), sig)
        os.execv(python, [python, *args])
    pid = state["pid"] = int(first[1])
    for sig in state["pending"]:
        os.kill(pid, sig)
    for fd in fds:  # the child holds them now: a pipe's reader sees EOF when the child exits
        if fd > 2:
            os.close(fd)
    line = replies.readline().split()
    if line[:1] != ["exit"]:
        print(f"warm_python: the server closed without the exit status of pid {pid}",
              file=sys.stderr)
        os._exit(70)
    code = int(line[1])
    if code < 0:  # killed by a signal: die of the same one
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code & 0xFF)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        from warm_server import serve

        serve(sys.argv[2], int(sys.argv[3]))
    elif sys.argv[1:2] == ["client"]:
        client(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:])
    else:
        raise SystemExit(f"usage: {sys.argv[0]} serve SOCKET PARENT_PID | "
                         f"client SOCKET PYTHON WRAPPER ARGS...")
