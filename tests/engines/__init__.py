"""Tests against the engines' own code (vLLM, SGLang), fetched at install time."""

import importlib.util

import pytest


def skip_module_without_vllm() -> None:
    """Skip the test module that calls this (at its top) when vLLM is not installed.

    It looks the package up without importing it: importing vLLM costs some 13 s of CPU,
    which each pytest-xdist worker would pay at collection, for files most of them never
    run; the tests import what they use."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm==0.33.0 is installed by make test (--no-deps): make install-vllm",
                    allow_module_level=True)
