"""A mutation pass over the library's source: do the tests catch a wrong line?

One mutation at a time, made on the syntax tree of one module (``ast``, so the mutated
file is the module unparsed: comments go, behaviour stays), written into a copy of
``src`` under ``--copy`` (never into the checkout), and the chosen tests run on the copy
(``PYTHONPATH``), ``-x``, niced, under a timeout. A mutant no test fails *survived*: either
it is equivalent (the same behaviour, or a cost alone) or a test is missing.

Mutations: a comparison flipped (``<`` ``<=``, ``==`` ``!=``, ``is`` ``is not``, ``in``
``not in``), ``and``/``or`` swapped, a ``not`` dropped, a slice bound or ``range``'s last
argument or an integer operand off by one, ``+=``/``-=`` swapped, ``break``/``continue``
swapped, a statement dropped (a call, an augmented or attribute/subscript assignment, an
``if``, a ``for``, a bare ``return``), a ``return`` at the top of a function returning
None.

    python tests/mutants.py list src/prefixkv/index/content.py ... > sites.jsonl
    python tests/mutants.py run sites.jsonl results.jsonl --tests tests/test_claim.py ...
    python tests/mutants.py show 'prefixkv/index/content.py#412#cmp#0'

``run`` resumes (mutants in ``results.jsonl`` are skipped) and stops between mutants once
the file ``<copy>/STOP`` exists. ``--fork`` runs each mutant's tests in a child forked from
this process after it has imported what the tests import (vLLM, torch, hypothesis: never
prefixkv or the tests' own modules, which each child imports fresh from the mutated copy):
a kill costs about a third of a fresh interpreter's (mutants-r26: 5.3 s against 15.5 s).
``--cap N`` (default 15) caps every Hypothesis test's
examples at N and turns shrinking off, for a first pass (a plugin, ``-p mutants``, loaded
from this folder when the copy's tests run); rerun a survivor's tests at full settings
before calling it equivalent. Use ``nice`` and sample: each mutant runs its tests once.
First used by mutants-r18 (its report lists what it found).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLIP = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt,
        ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.Is: ast.IsNot, ast.IsNot: ast.Is,
        ast.In: ast.NotIn, ast.NotIn: ast.In}
DROPPED = (ast.Expr, ast.AugAssign, ast.Assign, ast.Delete, ast.If, ast.For, ast.Return)


def _doc(stmt, body):
    return (stmt is body[0] and isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)
            and isinstance(stmt.value.value, str))


def sites(tree):
    """Every mutation of ``tree``: (node index in ``ast.walk`` order, kind, detail, line)."""
    out = []
    for i, node in enumerate(ast.walk(tree)):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Compare):
            out += [(i, "cmp", j, line) for j, op in enumerate(node.ops) if type(op) in FLIP]
        elif isinstance(node, ast.BoolOp):
            out.append((i, "boolop", 0, line))
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            out.append((i, "notdrop", 0, line))
        elif isinstance(node, ast.Slice):
            out += [(i, "slice", f"{part}{d}", line) for part in ("lower", "upper")
                    if getattr(node, part) is not None for d in ("+1", "-1")]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "range":
            out += [(i, "range", d, line) for d in ("+1", "-1")]
        elif isinstance(node, ast.BinOp) and isinstance(node.right, ast.Constant) \
                and type(node.right.value) is int:
            out += [(i, "const", d, line) for d in ("+1", "-1")]
        elif isinstance(node, ast.AugAssign):
            out.append((i, "augop", 0, line))
        elif isinstance(node, (ast.Break, ast.Continue)):
            out.append((i, "loop", 0, line))
        if isinstance(node, ast.FunctionDef) and node.name != "__init__" and not any(
                isinstance(n, ast.Return) and n.value is not None or isinstance(n, (ast.Yield, ast.YieldFrom))
                for n in ast.walk(node)):
            out.append((i, "early", 0, line))
        for field in ("body", "orelse", "finalbody"):
            body = getattr(node, field, None)
            if not isinstance(body, list):
                continue
            for k, stmt in enumerate(body):
                local = isinstance(stmt, ast.Assign) and all(isinstance(t, ast.Name) for t in stmt.targets)
                if _doc(stmt, body) or not isinstance(stmt, DROPPED) or local \
                        or isinstance(stmt, ast.Return) and stmt.value is not None:
                    continue  # (a dropped local binding is a NameError: no news)
                out.append((i, "drop", f"{field}:{k}", stmt.lineno))
    return out


def mutated(path, site):
    """The source of ``path`` with mutation ``site`` applied."""
    tree = ast.parse(Path(path).read_text())
    idx, kind, detail, _ = site
    node = list(ast.walk(tree))[idx]
    new = None
    if kind == "cmp":
        node.ops[detail] = FLIP[type(node.ops[detail])]()
    elif kind == "boolop":
        node.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
    elif kind == "notdrop":
        new = node.operand
    elif kind in ("slice", "range", "const"):
        op = ast.Add() if detail.endswith("+1") else ast.Sub()
        if kind == "slice":
            part = detail[:-2]
            setattr(node, part, ast.BinOp(getattr(node, part), op, ast.Constant(1)))
        elif kind == "range":
            node.args[-1] = ast.BinOp(node.args[-1], op, ast.Constant(1))
        else:
            node.right = ast.Constant(node.right.value + (1 if detail == "+1" else -1))
    elif kind == "augop":
        node.op = ast.Sub() if isinstance(node.op, ast.Add) else ast.Add()
    elif kind == "loop":
        new = ast.Continue() if isinstance(node, ast.Break) else ast.Break()
    elif kind == "early":
        node.body.insert(1 if _doc(node.body[0], node.body) else 0, ast.Return(None))
    else:
        field, k = detail.split(":")
        getattr(node, field)[int(k)] = ast.Pass()
    if new is not None:
        for parent in ast.walk(tree):
            for name, value in ast.iter_fields(parent):
                if value is node:
                    setattr(parent, name, new)
                elif isinstance(value, list) and any(v is node for v in value):
                    value[[id(v) for v in value].index(id(node))] = new
    return ast.unparse(ast.fix_missing_locations(tree))


def key(module, site):
    return f"{module}#{site[0]}#{site[1]}#{site[2]}"


def parse_key(k):
    module, idx, kind, detail = k.split("#")
    path = ROOT / "src" / module
    return module, path, next(s for s in sites(ast.parse(path.read_text()))
                              if s[0] == int(idx) and s[1] == kind and str(s[2]) == detail)


def run_tests(copy, tests, cap, timeout):
    env = dict(os.environ, PYTHONPATH=f"{Path(__file__).parent / 'mutants_plugin'}{os.pathsep}{copy}",
               PYTHONDONTWRITEBYTECODE="1", MUTANTS_CAP=str(cap),
               HYPOTHESIS_STORAGE_DIRECTORY=str(Path(copy).parent / "hypothesis"))
    cmd = ["nice", "-n", "10", sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
           *(["-p", "mutants_cap"] if cap else []), *tests]
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, start_new_session=True)
    try:
        out, rc = p.communicate(timeout=timeout)[0], p.returncode
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, rc = p.communicate()[0], "timeout"
    failed = next((ln for ln in out.splitlines() if ln.startswith(("FAILED", "ERROR"))), "")
    status = {0: "survived", 1: "killed", "timeout": "timeout"}.get(rc, f"error {rc}")
    return {"status": status, "killer": failed[:300], "secs": round(time.monotonic() - t0, 1)}


def _ours(copy):
    """Whether a module is one each child must import fresh: prefixkv, the tests, the copy."""
    mine = tuple(str(d) for d in (ROOT / "src", ROOT / "tests", Path(copy).parent))

    def ours(name):
        if name.split(".")[0] in ("prefixkv", "conftest") or "conftest" in name:
            return True
        return (getattr(sys.modules.get(name), "__file__", None) or "").startswith(mine)
    return ours


def _child(copy, tests, cap, out, collect_only=False):
    """Fork a child that runs pytest on ``tests`` with its output in ``out``; the child's pid."""
    pid = os.fork()
    if pid:
        return pid
    rc = 3
    try:
        os.setpgid(0, 0)
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.nice(10)
        import pytest
        rc = pytest.main(["-x", "-q", "-p", "no:cacheprovider", *(["-p", "mutants_cap"] if cap else []),
                          *(["--collect-only"] if collect_only else []), *tests])
        if collect_only:
            ours = _ours(copy)
            names = [m for m in list(sys.modules) if not ours(m)]
            Path(out).with_suffix(".modules").write_text("\n".join(names))
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(int(rc))


def _wait(pid, timeout):
    t0 = time.monotonic()
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() - t0 > timeout:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "timeout"
        time.sleep(0.2)


def preload(copy, tests, cap):
    """Set this process up as a fork server: the copy first on ``sys.path``, and every module a
    first child (collecting the tests on the unmutated copy) imported, prefixkv's and the
    tests' own aside, imported here."""
    os.environ.update(PYTHONDONTWRITEBYTECODE="1", MUTANTS_CAP=str(cap),
                      HYPOTHESIS_STORAGE_DIRECTORY=str(Path(copy).parent / "hypothesis"))
    sys.dont_write_bytecode = True
    sys.path[:0] = [str(Path(__file__).parent / "mutants_plugin"), str(copy)]
    os.chdir(ROOT)
    out = Path(copy).parent / "preload.txt"
    if _wait(_child(copy, tests, cap, str(out), collect_only=True), 600) != 0:
        raise RuntimeError(f"collecting the tests on the unmutated copy failed: see {out}")
    for name in out.with_suffix(".modules").read_text().split():
        try:
            importlib.import_module(name)
        except BaseException:  # a module that needs what only a test sets up: the child imports it
            pass
    if any(name.split(".")[0] == "prefixkv" for name in sys.modules):
        raise RuntimeError("prefixkv was imported by the preload: the children would test it unmutated")


def run_forked(copy, tests, cap, timeout):
    out = str(Path(copy).parent / "out.txt")
    t0 = time.monotonic()
    rc = _wait(_child(copy, tests, cap, out), timeout)
    text = Path(out).read_text(errors="replace")
    failed = next((ln for ln in text.splitlines() if ln.startswith(("FAILED", "ERROR"))), "")
    status = {0: "survived", 1: "killed", "timeout": "timeout"}.get(rc, f"error {rc}")
    return {"status": status, "killer": failed[:300], "secs": round(time.monotonic() - t0, 1)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    ls = sub.add_parser("list")
    ls.add_argument("paths", nargs="+")
    rn = sub.add_parser("run")
    rn.add_argument("sample")
    rn.add_argument("results")
    rn.add_argument("--tests", nargs="+", required=True)
    rn.add_argument("--copy", default="/tmp/prefixkv-mutants/src")
    rn.add_argument("--cap", type=int, default=15)
    rn.add_argument("--timeout", type=int, default=240)
    rn.add_argument("--fork", action="store_true", help="run each mutant's tests in a forked child")
    sh = sub.add_parser("show")
    sh.add_argument("key")
    a = ap.parse_args()
    if a.cmd == "list":
        for p in a.paths:
            module = str(Path(p).resolve().relative_to(ROOT / "src"))
            for s in sites(ast.parse(Path(p).read_text())):
                print(json.dumps({"key": key(module, s), "line": s[3]}))
    elif a.cmd == "show":
        module, path, site = parse_key(a.key)
        before = ast.unparse(ast.parse(path.read_text())).splitlines()
        after = mutated(path, site).splitlines()
        import difflib
        print("\n".join(difflib.unified_diff(before, after, module, module, n=0, lineterm="")))
    else:
        copy = Path(a.copy)
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(ROOT / "src", copy, ignore=shutil.ignore_patterns("__pycache__"))
        if a.fork:
            preload(copy, a.tests, a.cap)
        run = run_forked if a.fork else run_tests
        done = set()
        if os.path.exists(a.results):
            done = {json.loads(ln)["key"] for ln in open(a.results)}
        for ln in open(a.sample):
            k = json.loads(ln)["key"]
            if k in done or (copy / "STOP").exists():
                continue
            module, path, site = parse_key(k)
            target = copy / module
            target.write_text(mutated(path, site))
            try:
                r = run(copy, a.tests, a.cap, a.timeout)
            finally:
                shutil.copy2(path, target)
            with open(a.results, "a") as f:
                f.write(json.dumps({"key": k, "line": site[3], **r}) + "\n")


if __name__ == "__main__":
    main()
