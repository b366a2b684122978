"""Bytecodes of ``Router.apply`` for one batch as the subscriber gets it (typed-r16).

The batch: four ``Stored`` runs of 16 int hashes and one ``Removed`` of two, as
``decode_batch`` returns them, applied to a fresh two-replica router (the batch's own
construction not counted). Counted: the public ``apply`` (which checks each event's
fields since typed-r16) and, where the tree has it, ``_apply_decoded`` (the subscriber's
path, without those checks). Deterministic: counted with ``sys.settrace``
(``prefixkv.bench.opcodes``), not timed; run it against two trees to compare:

    PYTHONPATH=src python benchmarks/router_apply_opcodes.py
"""

from __future__ import annotations

from prefixkv.bench.opcodes import count_opcodes
from prefixkv.router import Removed, Router, Stored
from prefixkv.router.decode import RouterEvent


def batch() -> list[RouterEvent]:
    """Four runs of 16 blocks stored, then two of them removed."""
    stored: list[RouterEvent] = [
        Stored(tuple(range(i * 16 + 1, i * 16 + 17)), None, "GPU", 0, None, None, 16)
        for i in range(4)]
    return [*stored, Removed((1, 2), "GPU", 0)]


def main() -> None:
    """Print each path's bytecodes per batch."""
    own = count_opcodes(batch)
    router = Router(["a", "b"], block_size=16, clock=lambda: 5.0)
    print(f"apply (public): {count_opcodes(lambda: router.apply('a', batch())) - own}")
    if hasattr(Router, "_apply_decoded"):
        router = Router(["a", "b"], block_size=16, clock=lambda: 5.0)
        n = count_opcodes(lambda: router._apply_decoded("a", batch())) - own
        print(f"_apply_decoded (the subscriber's): {n}")


if __name__ == "__main__":
    main()
