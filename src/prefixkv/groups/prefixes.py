"""Prefix ids: one id per distinct prefix content, shared by every group.

A block's KV in any layer depends on the whole prefix up to it, so its identity is the
prefix: ``(parent prefix id, token bytes, extra-key bytes)``, verified exactly (no hash is
trusted). The core's ``ContentIndex`` finds block j through block j-1 of the same index,
which a sliding-window group no longer holds once j-1 left the window; here the prefix ids
live in one table beside the groups, so a group's block is found by its prefix id alone,
whatever the group holds before it.

A node lives while something refers to it: each block indexed under it (in any group),
each child node, and each live request whose last recorded block it is (so a request's
later blocks always extend a live chain). The last reference dropped removes the node and
drops one reference on its parent. Ids are never reused.

A node whose KV turned out invalid is ``lost`` (``forget``): it leaves the table with its
descendants, so no walk reaches them and the same tokens computed again get a new node;
a lost node keeps its reference on its parent (counted in the parent's ``lost_kids``, as
no child in the table names it). Lost nodes live on while a block or request
refers to them, and the nodes extending one are lost too (never entered in the table):
what a request computes after a lost block read that block's KV.

Each node lists the children entered in the table under it (``kids``), so ``forget``
walks a forgotten node's descendants alone. A child is listed when it is entered and
never unlisted when it leaves the table (unhold, the hot path, writes nothing there): a
listed child is in the table only while it is not lost and something refers to it, and
the list is swept of the others when it outgrows twice its parent's references (each
child in the table holds one), so its length stays within a constant of them.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..core.block import ContentKey


class Prefix:
    """A node: ``pid`` (its id, > 0), ``parent`` (None for a first block), ``key`` (the
    table key: parent pid, token bytes, extra bytes), ``refs``, ``hash`` (the chain hash,
    when events are recorded, else None), ``lost`` (out of the table: ``forget``),
    ``lost_kids`` (the references lost children hold on it), ``kids`` (None, or the
    children entered in the table under it, stale ones among them: see the module)."""

    __slots__ = ("pid", "parent", "key", "refs", "hash", "lost", "lost_kids", "kids")

    def __init__(self, pid: int, parent: Prefix | None, key: ContentKey, hash: bytes | None,
                 lost: bool = False) -> None:
        self.pid, self.parent, self.key, self.refs, self.hash = pid, parent, key, 0, hash
        self.lost = lost
        self.lost_kids = 0
        self.kids: list[Prefix] | None = None

    def __repr__(self) -> str:
        return f"Prefix(pid={self.pid}, refs={self.refs})"


class PrefixTable:
    """Every live prefix node, keyed by content."""

    __slots__ = ("_nodes", "_next")

    def __init__(self) -> None:
        self._nodes: dict[ContentKey, Prefix] = {}
        self._next = 1

    def __len__(self) -> int:
        return len(self._nodes)

    def walk(self, chunks: Sequence[bytes], extras: Sequence[bytes], limit: int) -> list[Prefix]:
        """The nodes of blocks ``0..`` (``chunks[j]`` the token bytes of block j,
        ``extras[j]`` its extra bytes), up to ``limit`` blocks or the first unknown one.
        Changes nothing."""
        get = self._nodes.get
        out: list[Prefix] = []
        pid = 0
        for j in range(limit):
            node = get((pid, chunks[j], extras[j]))
            if node is None:
                break
            out.append(node)
            pid = node.pid
        return out

    def child(self, parent: Prefix | None, chunk: bytes, extra: bytes) -> Prefix | None:
        """The node in the table of the block after ``parent`` (None: a first block)
        holding ``chunk``/``extra``, None if there is none. Changes nothing."""
        return self._nodes.get((parent.pid if parent is not None else 0, chunk, extra))

    def holds(self, node: Prefix) -> bool:
        """Whether ``node`` is the table's node of its prefix (not lost, not dropped, not
        left out by ``clear``). Changes nothing."""
        return self._nodes.get(node.key) is node

    def extend(self, parent: Prefix | None, chunks: Sequence[bytes], extras: Sequence[bytes],
               hashes: Sequence[bytes] | None, cut: bool = False) -> list[Prefix]:
        """The nodes of the blocks after ``parent`` holding ``chunks``: found, or created
        (with ``hashes[i]`` as chain hash). A created node refers to its parent. After a
        lost ``parent``, or with ``cut`` (the request's block of ``parent`` lost its KV
        while the prefix stays: ``GroupIndex.cut_off``), every node is a new lost one,
        outside the table."""
        nodes = self._nodes
        out: list[Prefix] = []
        lost = cut or (parent is not None and parent.lost)
        for i, (chunk, extra) in enumerate(zip(chunks, extras, strict=True)):
            key = (parent.pid if parent is not None else 0, chunk, extra)
            h = hashes[i] if hashes is not None else None
            if lost:
                node = Prefix(self._next, parent, key, h, True)
                self._next += 1
                if parent is not None:
                    parent.refs += 1
                    parent.lost_kids += not parent.lost
            else:
                found = nodes.get(key)
                if found is None:
                    found = nodes[key] = Prefix(self._next, parent, key, h)
                    self._next += 1
                    if parent is not None:
                        parent.refs += 1
                        kids = parent.kids
                        if kids is None:
                            parent.kids = [found]
                        else:
                            if len(kids) > 2 * parent.refs + 4:  # (found: no reference yet)
                                kids[:] = [k for k in kids if k.refs and not k.lost]
                            kids.append(found)
                node = found
            out.append(node)
            parent = node
        return out

    def hold(self, node: Prefix | None) -> None:
        """Take a reference on ``node`` (None: nothing)."""
        if node is not None:
            node.refs += 1

    def unhold(self, node: Prefix | None) -> None:
        """Drop a reference; a node left with none goes, and so may its ancestors."""
        kid_lost = False
        while node is not None:
            node.refs -= 1
            assert node.refs >= 0, node
            if kid_lost and not node.lost:
                node.lost_kids -= 1
            if node.refs:
                return
            if not node.lost:
                del self._nodes[node.key]
            kid_lost = node.lost
            node = node.parent

    def forget(self, roots: Sequence[Prefix]) -> list[Prefix]:
        """Mark ``roots`` (nodes in the table) and every node of the table descending from
        one lost, and take them out of the table; each lost node whose parent stays keeps
        its reference on it (``lost_kids``: a request may still hold that parent, or
        rewind to it). Returns the nodes lost, ``roots`` first, then each one's
        descendants, parents before children. Walks the descendants alone (``kids``)."""
        out = list(dict.fromkeys(roots))
        for node in out:
            node.lost = True
        i = 0
        while i < len(out):  # (out grows as the walk goes: each node once, a tree)
            kids = out[i].kids
            i += 1
            if kids:
                for kid in kids:
                    if kid.refs and not kid.lost:  # (in the table: see the module)
                        kid.lost = True
                        out.append(kid)
        for node in out:
            del self._nodes[node.key]
            node.kids = None
        for node in out:
            if node.parent is not None and not node.parent.lost:
                node.parent.lost_kids += 1
        return out

    def clear(self) -> None:
        self._nodes.clear()

    def check(self, refs: dict[int, int]) -> str | None:
        """The first node whose count differs from ``refs`` (pid -> references held by
        blocks and requests, children added here, lost ones too), None when sound."""
        want = dict(refs)
        listed = {id(k) for node in self._nodes.values() for k in node.kids or ()}
        for node in self._nodes.values():
            if node.parent is not None:
                if self._nodes.get(node.parent.key) is not node.parent:
                    return f"{node!r} has a parent that is not in the table"
                if id(node) not in listed:
                    return f"{node!r} is not listed among its parent's kids"
                want[node.parent.pid] = want.get(node.parent.pid, 0) + 1
        for node in self._nodes.values():
            want[node.pid] = want.get(node.pid, 0) + node.lost_kids
        for node in self._nodes.values():
            if node.refs != want.get(node.pid, 0) or not node.refs or node.lost_kids < 0:
                return f"{node!r}: {want.get(node.pid, 0)} references found"
        return None
