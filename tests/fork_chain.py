"""The state machines' ``fork_chain`` rule, shared by the plain and the hybrid manager's
machines (``test_state_machine``, ``test_groups_state_machine``)."""

from hypothesis.stateful import multiple


def fork_chain_step(machine, parent, depth, gone, toks, prompt, models, run_plan):
    """One step, no plan run until its end (``schedule_fork_chain``); then
    ``check_invariants`` (the plan's copies are a closed set before it is taken), the
    plan (``run_plan``) and the forward pass. Returns the new live requests."""
    if parent not in machine.tokens or machine.scheduled[parent] != len(machine.tokens[parent]):
        return multiple()
    live, writes = schedule_fork_chain(machine, parent, depth, gone, toks, prompt, models)
    machine.m.check_invariants()
    run_plan()
    for w in writes:
        if w[0] in machine.tokens:
            machine._forward(*w)
    machine.last = None
    return multiple(*live)


def schedule_fork_chain(machine, parent, depth, gone, toks, prompt, models):
    """Fork ``parent`` into a chain of ``depth`` children, each forked from the one before
    (a fork of a fork: the plan owes the copies in order); append ``toks[i]`` to member i
    of the chain (the parent is member 0); free the members in ``gone`` (beams pruned
    before the step ran: freed with the tokens computed before it); admit ``prompt`` (it
    may take a freed block). No plan runs. ``models``: the machine's per-request dicts a
    child inherits. Returns the live children and admitted request, and the writes
    ``(rid, start, stop)`` the step's forward pass owes."""
    m = machine.m
    chain = [parent]
    for _ in range(depth):
        child = machine._new_id()
        if m.fork(chain[-1], child) is None:
            break
        chain.append(child)
        for model in models:
            model[child] = model[chain[-2]]
        machine.tokens[child] = list(machine.tokens[child])
    writes = []
    for rid, tok in zip(chain, toks, strict=False):
        n = machine.scheduled[rid]
        if m.append_tokens(rid, [tok]) is not None:
            machine.tokens[rid].append(tok)
            machine.scheduled[rid] = n + 1
            machine.reserved[rid] = max(machine.reserved[rid], n + 1)
            writes.append((rid, n, n + 1))
    for i in sorted(gone):
        if i < len(chain):
            rid = chain[i]
            computed = next((w[1] for w in writes if w[0] == rid), machine.scheduled[rid])
            m.free(rid, num_computed_tokens=computed)
            machine._forget(rid)
    if prompt is not None:
        rid = machine._new_id()
        adm = machine._add(rid, prompt)
        if adm is not None:
            machine.tokens[rid], machine.extra[rid] = list(prompt), None
            machine.scheduled[rid] = machine.reserved[rid] = len(prompt)
            writes.append((rid, adm.num_cached_tokens, len(prompt)))
            chain.append(rid)
    return [r for r in chain[1:] if r in machine.tokens], writes
