"""The server side of tests/warm_python.py (read that first): one process that imports
``PRELOAD`` and forks a child per client's request, and the child that becomes the
client's process and runs its command as ``python`` would."""

from __future__ import annotations

import fcntl
import json
import os
import selectors
import signal
import socket
import sys
from typing import Any

import warm_python as warm


def serve(path: str, parent: int) -> None:
    """Import ``PRELOAD``, listen at ``path``, print "ready"; fork a child per request,
    until SIGTERM (which kills every child's process group first), sent by the fixture or
    by the kernel when process ``parent`` dies. One thread (no lock
    can be held at a fork): the listener, the clients' connections and the children
    (pidfds) are waited on together. A client's failure never stops the server."""
    import importlib

    _die_with(parent, signal.SIGTERM)  # its pytest worker (``parent``) killed: it goes too
    for name in warm.PRELOAD:
        importlib.import_module(name)
    if sys.modules["torch"].cuda.is_initialized():  # a forked child could not use CUDA
        raise SystemExit("warm_python: importing torch initialized CUDA; not serving")
    base_env = dict(os.environ)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen(64)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, None)
    children: set[int] = set()

    def stop(_sig: int, _frame: object) -> None:
        for child in children:
            _kill_group(child)
        os._exit(0)  # nothing to write: an interpreter's exit with torch took 0.7-5 s

    signal.signal(signal.SIGTERM, stop)
    print("ready", flush=True)
    while True:
        for key, _ in sel.select():
            if key.data is None:
                conn, _ = listener.accept()
                child = _start(conn, base_env, sel)
                if child is None:
                    conn.close()
                    continue
                children.add(child)
                sel.register(os.pidfd_open(child), selectors.EVENT_READ, ("child", child, conn))
                try:
                    conn.sendall(f"pid {child}\n".encode())
                    sel.register(conn, selectors.EVENT_READ, ("client", child))
                except OSError:  # the client is gone already (killed while it waited)
                    _kill_group(child)
            elif key.data[0] == "client":  # readable only at EOF: the client was killed
                sel.unregister(key.fileobj)
                _kill_group(key.data[1])
            else:
                _, child, conn = key.data
                status = os.waitpid(child, 0)[1]
                children.discard(child)
                sel.unregister(key.fd)
                os.close(key.fd)
                if _registered(sel, conn):
                    sel.unregister(conn)
                try:
                    conn.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
                except OSError:
                    pass
                conn.close()


def _registered(sel: selectors.BaseSelector, conn: socket.socket) -> bool:
    try:
        sel.get_key(conn)
    except KeyError:
        return False
    return True


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _start(conn: socket.socket, base_env: dict[str, str], sel: selectors.BaseSelector) -> int | None:
    """Read one request from ``conn`` and fork its child; None when there is none (the
    client went away, or it is declined: then the client is told to fall back)."""
    fds: list[int] = []
    try:
        head, fds, _, _ = socket.recv_fds(conn, 1 << 20, warm.MAX_FDS)
        size = int.from_bytes(head[:8], "little")
        data = head[8:]
        while len(head) >= 8 and len(data) < size:
            more = conn.recv(size - len(data))
            if not more:
                break
            data += more
        if len(head) < 8 or len(data) < size:
            return None
        request = json.loads(data)
        if not warm.runnable(request["args"]) or warm.pinned(request["env"]) != warm.pinned(base_env):
            conn.sendall(b"fallback\n")
            return None
        sys.stdout.flush()
        sys.stderr.flush()
        server = os.getpid()
        # blocked until the child has the dispositions of the client's process (the
        # server's SIGTERM handler must never run there); a forwarded signal waits
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, warm.FORWARDED)
        pid = os.fork()
        if pid == 0:
            sel.close()
            _child(request, fds, base_env, server)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        return pid
    except OSError:
        return None
    finally:
        for fd in fds:  # the child has them (or nobody needs them)
            os.close(fd)


def _child(request: dict[str, Any], received: list[int], base_env: dict[str, str],
           server: int) -> None:
    """In the forked child: become the client's process, run its command; never returns."""
    code = 1
    try:
        os.setsid()  # a group of its own: killed whole when the client dies
        _die_with(server)
        # the received descriptors above every number in use, the rest closed, then each
        # put at the number it had in the client
        high = max([fd for fd, _ in request["fds"]] + received + [2]) + 1
        moved = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, high) for fd in received]
        for n in map(int, os.listdir("/proc/self/fd")):
            if n not in moved:
                _close(n)
        for (target, inheritable), fd in zip(request["fds"], moved, strict=True):
            os.dup2(fd, target, inheritable=inheritable)
            os.close(fd)
        code = _run(request, base_env)
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException:  # noqa: BLE001  printed as the interpreter prints it
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


def _die_with(parent: int, sig: int = signal.SIGKILL) -> None:
    """``sig`` when ``parent`` dies (Linux's PR_SET_PDEATHSIG): a child whose server was
    killed outright, a server whose pytest worker was, is not left behind."""
    import ctypes

    ctypes.CDLL(None).prctl(1, sig)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before that
        os._exit(1)


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def _run(request: dict[str, Any], base_env: dict[str, str]) -> int:
    """Run the command as ``python`` would in this process; its exit status."""
    import io
    import runpy
    import threading
    import types

    env = request["env"]
    for sig in warm.FORWARDED:  # as the client's parent left them, as the interpreter sets them
        default = signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
        signal.signal(sig, signal.SIG_IGN if sig in request["ignored"] else default)
    os.chdir(request["cwd"])
    os.umask(request["umask"])
    os.environ.clear()
    os.environ.update(env)
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)))
    for name, fd in (("stdout", 1), ("stderr", 2)):
        raw = io.FileIO(fd, "w", closefd=False)
        stream: io.TextIOWrapper = io.TextIOWrapper(raw if unbuffered else io.BufferedWriter(raw),
                                  line_buffering=fd == 2 or raw.isatty(), write_through=unbuffered,
                                  errors="backslashreplace" if fd == 2 else None)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    args = warm.without_b(request["args"])
    sys.dont_write_bytecode = bool(env.get("PYTHONDONTWRITEBYTECODE")) or args != request["args"]
    # the server's path less its script folder and its PYTHONPATH: stdlib and site-packages
    own = {os.path.abspath(p) for p in base_env.get("PYTHONPATH", "").split(os.pathsep) if p}
    site = [p for p in sys.path[1:] if os.path.abspath(p) not in own]
    sys.executable = request["executable"]
    if "multiprocessing" in sys.modules:
        sys.modules["multiprocessing"].set_executable(sys.executable)
    first = {"-c": "", "-": "", "-m": os.getcwd()}.get(args[0])
    if first is None:
        first = os.path.dirname(os.path.realpath(args[0]))
    extra = [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [first, *extra, *site]
    sys.path_importer_cache.clear()
    code = 0
    signal.pthread_sigmask(signal.SIG_UNBLOCK, warm.FORWARDED)  # what came meanwhile, now
    try:
        try:
            if args[0] == "-m":
                sys.argv = [args[1], *args[2:]]
                runpy.run_module(args[1], run_name="__main__", alter_sys=True)
            elif args[0] in ("-c", "-"):
                source = args[1] if args[0] == "-c" else sys.stdin.read()
                sys.argv = [args[0], *args[2 if args[0] == "-c" else 1:]]
                main = types.ModuleType("__main__")
                sys.modules["__main__"] = main
                exec(compile(source, "<string>" if args[0] == "-c" else "<stdin>", "exec"),
                     main.__dict__)
            else:
                sys.argv = list(args)
                runpy.run_path(args[0], run_name="__main__")
        except SystemExit as exc:
            code = _exit_code(exc)
        except KeyboardInterrupt:
            _print_exception()
            code = -signal.SIGINT
        except BaseException:  # noqa: BLE001  printed as the interpreter prints it
            _print_exception()
            code = 1
        threading._shutdown()  # type: ignore[attr-defined]  # as the interpreter's exit does
        import atexit

        atexit._run_exitfuncs()
    finally:
        for out in (sys.stdout, sys.stderr):
            try:
                out.flush()
            except (OSError, ValueError):
                pass
    if code < 0:  # as Python exits on an uncaught KeyboardInterrupt: by the signal
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


def _print_exception() -> None:
    exc = sys.exc_info()[1]
    assert exc is not None, "called outside an except block"
    tb = exc.__traceback__  # from the command's own first frame, as python prints it
    while tb is not None and tb.tb_frame.f_code.co_filename in (_HERE, "<frozen runpy>"):
        tb = tb.tb_next
    sys.excepthook(type(exc), exc.with_traceback(tb), tb)


_HERE = _print_exception.__code__.co_filename


def _exit_code(exc: SystemExit) -> int:
    """The status ``sys.exit(arg)`` gives: None 0, an int itself, anything else 1 (printed)."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)
    return 1
