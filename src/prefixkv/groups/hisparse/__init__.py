"""HiSparse's state, as prefixkv would hold it (docs/integration.md, "HiSparse"): so far
the resident row's page life-cycle (``row.ResidentRow``) and the copies to host in flight
(``spills.Spills``). Implementation, not API: nothing in the managers or the vLLM plug-in
uses them yet, and a HiSparse layout is still refused at construction."""
