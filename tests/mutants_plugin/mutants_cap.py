"""pytest plugin for ``tests/mutants.py run --cap N``: every Hypothesis test at most N
examples (stateful ones at most 30 steps), without shrinking (a first pass over many
mutants: a failure is all it needs)."""

import os

import hypothesis

CAP = int(os.environ.get("MUTANTS_CAP", "15"))
NO_SHRINK = (hypothesis.Phase.explicit, hypothesis.Phase.reuse, hypothesis.Phase.generate)
_init = hypothesis.settings.__init__


def _capped(self, parent=None, **kw):
    if "max_examples" in kw:
        kw["max_examples"] = min(kw["max_examples"], CAP)
    if "stateful_step_count" in kw:
        kw["stateful_step_count"] = min(kw["stateful_step_count"], 30)
    kw.setdefault("phases", NO_SHRINK)
    _init(self, parent, **kw)


hypothesis.settings.__init__ = _capped


def pytest_collection_modifyitems(session, config, items):
    """The profile conftest loaded, capped (tests without their own settings)."""
    now = hypothesis.settings.default
    hypothesis.settings.register_profile("mutants-cap", parent=now, phases=NO_SHRINK,
                                         max_examples=min(now.max_examples, CAP))
    hypothesis.settings.load_profile("mutants-cap")
