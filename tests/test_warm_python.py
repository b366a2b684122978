"""tests/warm_python.py: a command run through the warm interpreter behaves as under the
real one (status, streams, argv, path, signals, subprocesses), in a fork that has torch."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

import warm_python as warm
from waiting import wait_until

pytest.importorskip("torch", reason="the warm interpreter preloads torch")
pytestmark = pytest.mark.skipif(not warm.supported(), reason="the warm interpreter needs Linux "
                                "(/proc, pidfds, descriptors passed over a Unix socket)")

# what a fresh interpreter would print; the fork also says that torch came preloaded
PROBE = "import os, sys; print(sys.argv, os.getcwd(), os.environ.get('PROBE'), 'torch' in sys.modules)"


def _run(python, *args, **kw):
    return subprocess.run([python, *args], capture_output=True, text=True, timeout=120, **kw)


def test_c_m_stdin_and_script_run_as_under_python(warm_python, tmp_path):
    env = {**os.environ, "PROBE": "x"}
    run = _run(warm_python, "-c", PROBE, "a", cwd=tmp_path, env=env)
    assert run.returncode == 0 and run.stdout == f"['-c', 'a'] {tmp_path} x True\n", run.stderr
    run = _run(warm_python, "-", "b", input=PROBE, cwd=tmp_path, env=env)
    assert run.stdout == f"['-', 'b'] {tmp_path} x True\n", run.stderr
    script = tmp_path / "probe.py"
    script.write_text("import helper\n" + PROBE)  # the script's folder comes first on the path
    (tmp_path / "helper.py").write_text("")
    run = _run(warm_python, str(script), "c", env=env)
    assert run.stdout == f"[{str(script)!r}, 'c'] {os.getcwd()} x True\n", run.stderr
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__main__.py").write_text(PROBE)
    run = _run(warm_python, "-m", "pkg", "d", cwd=tmp_path, env=env)
    main = str(tmp_path / "pkg" / "__main__.py")
    assert run.stdout == f"[{main!r}, 'd'] {tmp_path} x True\n", run.stderr


def test_exit_status_and_uncaught_exceptions_as_under_python(warm_python):
    assert _run(warm_python, "-c", "import sys; sys.exit(3)").returncode == 3
    run = _run(warm_python, "-c", "import sys; sys.exit('no luck')")
    assert run.returncode == 1 and run.stderr == "no luck\n"
    run = _run(warm_python, "-c", "raise ValueError('boom')")
    assert run.returncode == 1 and run.stderr == ('Traceback (most recent call last):\n'
                                                  '  File "<string>", line 1, in <module>\n'
                                                  "ValueError: boom\n")  # no frame of ours
    # at exit: atexit handlers run, non-daemon threads are joined, buffered output flushed
    code = ("import atexit, threading, time, sys\n"
            "atexit.register(lambda: print('atexit'))\n"
            "threading.Thread(target=lambda: (time.sleep(0.2), print('thread'))).start()\n"
            "sys.stdout.write('unflushed ')\n")
    assert _run(warm_python, "-c", code).stdout == "unflushed thread\natexit\n"


def test_pythonpath_is_the_commands_own(warm_python, tmp_path):
    (tmp_path / "only_here.py").write_text("WHERE = 'here'\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ["PYTHONPATH"]])}
    run = _run(warm_python, "-c", "import only_here; print(only_here.WHERE)", env=env)
    assert run.stdout == "here\n", run.stderr
    assert _run(warm_python, "-c", "import only_here").returncode == 1


def test_a_pinned_variable_set_otherwise_runs_the_real_interpreter(warm_python):
    env = {**os.environ, "OMP_NUM_THREADS": "3"}
    run = _run(warm_python, "-c", "import sys; print('torch' in sys.modules)", env=env)
    assert run.stdout == "False\n", run.stderr
    run = _run(warm_python, "-X", "utf8", "-c", "import sys; print('torch' in sys.modules)")
    assert run.stdout == "False\n", run.stderr  # an option it does not take


def test_subprocesses_and_spawned_workers_are_warm_too(warm_python, tmp_path):
    script = tmp_path / "pool.py"
    script.write_text(textwrap.dedent("""\
        import multiprocessing, subprocess, sys

        def warm(x):
            return x, 'torch' in sys.modules

        if __name__ == '__main__':
            with multiprocessing.get_context('spawn').Pool(2) as pool:
                print(pool.map(warm, [1, 2]))
            print(subprocess.run([sys.executable, '-c', 'import sys; print("torch" in sys.modules)'],
                                 capture_output=True, text=True).stdout, end='')
        """))
    run = _run(warm_python, str(script))
    assert run.returncode == 0 and run.stdout == "[(1, True), (2, True)]\nTrue\n", run.stderr


def test_a_signal_reaches_the_command(warm_python):
    code = ("import time\ntry:\n    print('ready', flush=True)\n    time.sleep(60)\n"
            "except KeyboardInterrupt:\n    print('interrupted')\n    raise\n")
    # SIGINT as a shell leaves it (a pytest-xdist worker ignores it, and so would its children)
    proc = subprocess.Popen([warm_python, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stdout.readline() == "ready\n"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    # as Python exits on an uncaught KeyboardInterrupt: the traceback, then by the signal
    assert out == "interrupted\n" and proc.returncode == -signal.SIGINT, err
    assert err.rstrip().endswith("KeyboardInterrupt")


def test_killing_the_client_kills_the_command_and_what_it_started(warm_python, tmp_path):
    mark = tmp_path / "sub.pid"
    sub = f"import os, time; open({str(mark)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    code = ("import os, subprocess, sys, time\n"
            f"subprocess.Popen([sys.executable, '-c', {sub!r}])\n"
            f"while not os.path.exists({str(mark)!r}) or not open({str(mark)!r}).read():\n"
            "    time.sleep(0.01)\n"
            f"print(os.getpid(), open({str(mark)!r}).read(), flush=True)\ntime.sleep(60)\n")
    proc = subprocess.Popen([warm_python, "-c", code], stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in proc.stdout.readline().split()]
    proc.kill()
    proc.wait()
    proc.stdout.close()
    # the command's subprocess ran through a client of its own, which died with the
    # command's process group; the server then killed what that client ran as well
    wait_until(lambda: not any(_running(p) for p in pids), "the command and its subprocess to die")


def test_a_client_killed_at_any_moment_leaves_nothing_running(warm_python):
    """SIGTERM from the start of the client to the child's run (a pool terminating a worker
    that is still starting): the client dies as a process would, the server goes on and
    its child, if it was forked, is killed."""
    import time

    for delay in range(0, 120, 8):
        proc = subprocess.Popen([warm_python, "-c", "import time; time.sleep(60)"])
        time.sleep(delay / 1000)
        proc.terminate()
        assert proc.wait(60) == -signal.SIGTERM
    server = int(_run(warm_python, "-c", "import os; print(os.getppid())").stdout)
    wait_until(lambda: not _children(server), "the server's children to go")


def _children(pid: int) -> list[int]:
    out = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry))
        except (FileNotFoundError, ProcessLookupError):  # it exited meanwhile
            pass
    return out


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone before the open, or the read
        return False


def test_a_server_goes_when_the_process_that_started_it_is_killed(tmp_path):
    """(A pytest worker killed outright leaves no server importing or serving.)"""
    script = os.path.join(os.path.dirname(__file__), "warm_python.py")
    parent = ("import os, subprocess, sys, time\n"
              f"server = subprocess.Popen([sys.executable, {script!r}, 'serve', {str(tmp_path / 's')!r},\n"
              "                           str(os.getpid())],\n"
              "                          stdout=subprocess.DEVNULL)\n"
              "print(server.pid, flush=True)\ntime.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)
    server = int(proc.stdout.readline())
    proc.kill()
    proc.wait()
    proc.stdout.close()
    wait_until(lambda: not _running(server), "the server to go with its parent")


def test_without_a_server_the_client_runs_the_real_interpreter(tmp_path):
    client = os.path.join(os.path.dirname(__file__), "warm_python.py")
    run = _run(sys.executable, "-S", "-E", client, "client", str(tmp_path / "none"), sys.executable,
               "unused", "-c", "import sys; print('torch' in sys.modules)")
    assert run.returncode == 0 and run.stdout == "False\n", run.stderr
