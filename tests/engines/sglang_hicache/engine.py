"""SGLang's own code for the tests, loaded as examples/sglang_storage.py loads it (see
there: what is imported light, and the host-pool stand-in)."""

import pathlib
import runpy

import pytest

_EXAMPLE = runpy.run_path(str(pathlib.Path(__file__).resolve().parents[3] / "examples"
                              / "sglang_storage.py"))
HostPool, page_hashes = _EXAMPLE["HostPool"], _EXAMPLE["page_hashes"]


def load():
    """SGLang's modules; skips when SGLang is not installed (make test installs it)."""
    try:
        return _EXAMPLE["load"]()
    except ImportError as exc:
        pytest.skip(str(exc))
