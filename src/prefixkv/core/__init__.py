"""The core: blocks, the free queue, the pool (reference counts and free tiers), the
per-request state and the manager that an engine's scheduler calls. Pure Python."""
