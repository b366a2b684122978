"""Fetch an engine's release files once into ``.cache/engines/`` (used by ``make test``).

    python tests/engines/fetch.py vllm        # wheel + sdist of the pinned release

What it does, for vLLM (the only engine so far; pinned in ``PINS``):

1. the wheel, with ``pip download --no-deps`` (pip's own index, find-links and certs);
2. the sdist, which carries vLLM's ``tests/``: pip cannot prepare its metadata on a
   machine without CUDA, so the file itself is taken from the simple page (PEP 691 JSON)
   of the index pip uses (``pip config``'s ``global.index-url``, else
   ``pip._internal.models.index.PyPI.simple_url``), and checked against the sha256 the
   page gives;
3. ``tests/`` and ``pyproject.toml`` of the sdist, unpacked into
   ``.cache/engines/vllm-<version>/`` (the harness's root for vLLM's tests).

Files already present (and matching their hash) are not downloaded again. Any failure is
loud: a non-zero exit with the reason, never a silent skip (the tests that need these
files fail when they are missing, see tests/engines/vllm_suite.py).
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import subprocess
import sys
import tarfile
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache" / "engines"
PINS = {"vllm": "0.33.0"}
WHEEL_TAG = "cp38-abi3-manylinux_2_28_x86_64"


def index_url() -> str:
    """The simple index pip uses: the configured ``index-url``, else PyPI's."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"],
                         capture_output=True, text=True, check=False).stdout
    for line in out.splitlines():
        key, _, value = line.partition("=")
        if key.strip().endswith("index-url") and "extra" not in key:
            return value.strip().strip("'\"").rstrip("/")
    from pip._internal.models.index import PyPI
    return str(PyPI.simple_url).rstrip("/")


def sha256_of(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def sdist_entry(project: str, filename: str) -> tuple[str, str]:
    """(url, sha256) of ``filename`` on the project's simple page."""
    req = urllib.request.Request(f"{index_url()}/{project}/",
                                 headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        page = json.load(resp)
    for f in page["files"]:
        if f["filename"] == filename:
            return f["url"], f["hashes"]["sha256"]
    raise SystemExit(f"fetch: {filename} is not on {index_url()}/{project}/")


def fetch_wheel(project: str, version: str) -> pathlib.Path:
    wheel = CACHE / f"{project}-{version}-{WHEEL_TAG}.whl"
    if not wheel.exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "--only-binary=:all:", "-d", str(CACHE), f"{project}=={version}"],
                       check=True)
    if not wheel.exists():
        raise SystemExit(f"fetch: pip download gave no {wheel.name}")
    return wheel


def fetch_sdist(project: str, version: str) -> pathlib.Path:
    name = f"{project}-{version}.tar.gz"
    sdist = CACHE / name
    url, digest = sdist_entry(project, name)
    if sdist.exists() and sha256_of(sdist) == digest:
        return sdist
    part = sdist.with_suffix(".part")
    with urllib.request.urlopen(url, timeout=600) as resp, part.open("wb") as out:
        while chunk := resp.read(1 << 20):
            out.write(chunk)
    if sha256_of(part) != digest:
        part.unlink()
        raise SystemExit(f"fetch: {name} does not match the index's sha256 {digest}")
    part.rename(sdist)
    return sdist


def unpack_tests(sdist: pathlib.Path, project: str, version: str) -> pathlib.Path:
    top = f"{project}-{version}"
    dest = CACHE / top
    if (dest / "tests" / "__init__.py").exists():
        return dest
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers()
                   if m.name.startswith(f"{top}/tests/") or m.name == f"{top}/pyproject.toml"]
        tar.extractall(CACHE, members=members, filter="data")
    return dest


def main(argv: list[str]) -> int:
    projects = argv or list(PINS)
    CACHE.mkdir(parents=True, exist_ok=True)
    for project in projects:
        if project not in PINS:
            raise SystemExit(f"fetch: unknown engine {project!r}; known: {sorted(PINS)}")
        version = PINS[project]
        wheel = fetch_wheel(project, version)
        tests = unpack_tests(fetch_sdist(project, version), project, version)
        print(f"{project} {version}: {wheel.relative_to(ROOT)}, {tests.relative_to(ROOT)}/tests")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
