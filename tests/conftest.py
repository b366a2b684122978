"""Settings for the whole suite, applied before any test module imports torch.

One intra-op thread for torch (OpenMP): the suite's tensors are tiny, and a second thread
spends its time spin-waiting rather than computing, against the other pytest-xdist worker
(`make test` runs two) and against the machine's other work. Measured on the 2-core VM at a
load average under 1: tests/engine/test_engine.py took 24.4 s (33 s of CPU) with torch's
default two threads, 9.9 s (11.3 s of CPU) with one. Subprocesses (examples, benchmarks)
inherit it. Set OMP_NUM_THREADS yourself to override.
"""

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
if "torch" in sys.modules:  # a plugin imported it first: the variable came too late
    sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
