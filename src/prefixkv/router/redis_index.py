"""The block index in Redis/Valkey, shared by several router instances (extra
``prefixkv[redis]``: redis-py; any server speaking the Redis protocol with Lua).

Keys, under ``namespace`` (one per fleet: model, block size, hash mode and seed)::

    {ns}:b:{key}      SET of "{replica}|{medium}" holding the block
    {ns}:r:{replica}  SET of "{key}|{medium}" the replica holds (for clear)

``key`` is the wire hash: decimal for an int, ``x`` + hex for bytes; ``medium`` the
wire's, with ``%`` and ``|`` escaped (``%25``, ``%7C``: it comes off the wire as any str,
and a member is split at its last ``|``; replica names are the router's). Each call is one
round trip: a Lua script applies a whole run of stored or removed blocks, and another
walks a prompt's blocks on the server and returns only each replica's leading runs
(the holders of 128 blocks never cross the network). The scripts name every key they
touch, so they run on one server; a cluster would need the namespace in a hash tag.

One writer per namespace: let exactly one router instance subscribe and apply events
(others only route), so that the order of events per replica is kept.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .index import BlockIndexError, Hash, check_call, checked_names

# KEYS: block keys..., then the replica's key. ARGV: member, then "{key}|{medium}"...
_UPDATE = """
local op, n = ARGV[1], #KEYS - 1
for i = 1, n do redis.call(op, KEYS[i], ARGV[2]) end
for i = 1, n do redis.call(op, KEYS[n + 1], ARGV[i + 2]) end
return n
"""

# KEYS: the prompt's block keys in order. ARGV[1]: the GPU medium's name.
# Returns {replica, run, gpu_run, ...} for every replica holding the first block.
_RUNS = """
local active, gpu, run, grun = nil, {}, {}, {}
for i, key in ipairs(KEYS) do
  local here, here_gpu = {}, {}
  for _, m in ipairs(redis.call('SMEMBERS', key)) do
    local r, med = string.match(m, '^(.*)|([^|]*)$')
    here[r] = true
    if med == ARGV[1] then here_gpu[r] = true end
  end
  if active == nil then
    active = here
    for r in pairs(here_gpu) do gpu[r] = true end
  end
  for r in pairs(gpu) do
    if not here_gpu[r] then grun[r] = i - 1; gpu[r] = nil end
  end
  local left = false
  for r in pairs(active) do
    if not here[r] then run[r] = i - 1; active[r] = nil else left = true end
  end
  if not left then break end
end
local out = {}
for r in pairs(active or {}) do run[r] = #KEYS end
for r in pairs(gpu) do grun[r] = #KEYS end
for r, n in pairs(run) do
  if n > 0 then
    table.insert(out, r); table.insert(out, n); table.insert(out, grun[r] or 0)
  end
end
return out
"""


def _key(h: Hash) -> str:
    return str(h) if isinstance(h, int) else "x" + h.hex()


def _medium(medium: str) -> str:
    """``medium`` with no ``|`` in it (see the module doc)."""
    return medium.replace("%", "%25").replace("|", "%7C")


def _text(raw: object) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


class RedisIndex:
    """A BlockIndex over a ``redis.Redis`` client (``decode_responses`` either way). Each
    call raises BlockIndexError, before any command, for an argument of the wrong type
    (``BlockIndexError``'s doc: a list replica was stored as the name ``"['a']"``, a
    bool hash as the key ``True``, a str hash raised AttributeError)."""

    def __init__(self, client: object, namespace: str = "prefixkv") -> None:
        self.client = client
        self.ns = namespace
        self._update = client.register_script(_UPDATE)  # type: ignore[attr-defined]
        self._runs = client.register_script(_RUNS)  # type: ignore[attr-defined]

    def _apply(self, op: str, replica: str, hashes: Sequence[Hash], medium: str) -> None:
        check_call(BlockIndexError, replica, hashes, medium)
        if not hashes:
            return
        keys, medium = [_key(h) for h in hashes], _medium(medium)
        self._update(keys=[f"{self.ns}:b:{k}" for k in keys] + [f"{self.ns}:r:{replica}"],
                     args=[op, f"{replica}|{medium}", *[f"{k}|{medium}" for k in keys]])

    def store(self, replica: str, hashes: Sequence[Hash], medium: str) -> None:
        """See ``BlockIndex.store``."""
        self._apply("SADD", replica, hashes, medium)

    def remove(self, replica: str, hashes: Sequence[Hash], medium: str) -> None:
        """See ``BlockIndex.remove``."""
        self._apply("SREM", replica, hashes, medium)

    def clear(self, replica: str) -> None:
        """See ``BlockIndex.clear``."""
        check_call(BlockIndexError, replica)
        rkey = f"{self.ns}:r:{replica}"
        pipe = self.client.pipeline(transaction=False)  # type: ignore[attr-defined]
        for raw in self.client.smembers(rkey):  # type: ignore[attr-defined]
            key, medium = _text(raw).rsplit("|", 1)
            pipe.srem(f"{self.ns}:b:{key}", f"{replica}|{medium}")
        pipe.delete(rkey)
        pipe.execute()

    def prefix_runs(self, hashes: Sequence[Hash], replicas: Iterable[str]
                    ) -> dict[str, tuple[int, int]]:
        """See ``BlockIndex.prefix_runs``."""
        check_call(BlockIndexError, hashes=hashes)
        wanted = checked_names(BlockIndexError, replicas)
        if not hashes:
            return {}
        flat = self._runs(keys=[f"{self.ns}:b:{_key(h)}" for h in hashes], args=["GPU"])
        out = {}
        for i in range(0, len(flat), 3):
            name = _text(flat[i])
            if name in wanted:
                out[name] = (int(flat[i + 1]), int(flat[i + 2]))
        return out

    def num_blocks(self, replica: str) -> int:
        """See ``BlockIndex.num_blocks``."""
        check_call(BlockIndexError, replica)
        return int(self.client.scard(f"{self.ns}:r:{replica}"))  # type: ignore[attr-defined]

    def routed(self, replica: str, hashes: Sequence[Hash]) -> None:
        """See ``BlockIndex.routed``: ignored (the events say what the replica holds)."""
