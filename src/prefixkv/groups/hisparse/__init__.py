"""HiSparse's state, as prefixkv holds it (docs/integration.md, "HiSparse"): the resident
row's page life-cycle (``row.ResidentRow``), the copies to host in flight
(``spills.Spills``), and the requests of a layout on its host and device pools
(``state.HiSparseState``, on ``core.pool_unpin.UnpinPool``). Implementation, not API:
nothing in the managers or the vLLM plug-in uses them yet, and a HiSparse layout is still
refused at construction."""
