"""SGLang's own code for the tests, loaded as examples/sglang_storage.py loads it (see
there: what is imported light, and the host-pool stand-in)."""

import pathlib
import runpy

import pytest

_EXAMPLE = runpy.run_path(str(pathlib.Path(__file__).resolve().parents[3] / "examples"
                              / "sglang_storage.py"))
HostPool = _EXAMPLE["HostPool"]


def page_hashes(sgl, tokens, page_size, prior=None):
    """SGLang's page keys (its native hash); skips, naming the cause, when SGLang's loader
    cannot build that extension on this machine (it needs g++, ninja and OpenSSL's
    headers)."""
    try:
        return _EXAMPLE["page_hashes"](sgl, tokens, page_size, prior)
    except RuntimeError as exc:
        pytest.skip(f"SGLang's native page hash could not be built: {exc.__cause__ or exc}")


def load():
    """SGLang's modules; skips when SGLang is not installed (make test installs it)."""
    try:
        return _EXAMPLE["load"]()
    except ImportError as exc:
        pytest.skip(str(exc))
