"""``prefixkv bench``: prefix caching against naive allocation, on synthetic workloads or
a JSONL trace, with capacity planning and (where torch is installed) an end-to-end run.

Modules, one noun each: ``workloads`` (seeded request lists), ``trace`` (JSONL format and
parser), ``limits`` (caps on tokens and pools), ``errors``, ``replay`` (scheduler +
accounting), ``capacity`` (what fits, pool sweeps), ``cost`` (estimated prefill time of
the saved tokens), ``suite`` (a whole run), ``report`` / ``plots`` (outputs), ``outdir``
(the output folder, replaced whole), ``progress``, ``e2e``, ``layer_groups`` (what
per-group tables buy a hybrid model), ``cascade_bytes`` (KV bytes read per step with and
without cascade attention).
Nothing here imports torch at import time.
"""
