"""What every adapter over a radix tree does the same way, whatever the engine: node handles, the tree walked parents
first, and an allocator's "no room" turned into the spec's error. Plain Python: no torch, no engine import.

A handle is an int the harness passes back in later calls and reads off snapshots (`NodeView.id`). An engine's
node ids are the natural handles, but a node the engine makes without returning it (the head of a split) is first
seen in a snapshot; `NodeHandles` resolves such a handle by walking the tree once more, and a handle no walk finds
is the spec's `StaleHandle`, never a KeyError out of the adapter.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Generic, Optional, TypeVar

from kvcert.spec.types import PoolExhausted, StaleHandle

__all__ = ["NodeHandles", "take_slots", "walk_tree"]

N = TypeVar("N")


def walk_tree(root: N, children: Callable[[N], Iterable[N]]) -> Iterator[tuple[N, Optional[N]]]:
    """(node, parent) for every node reachable from `root`, parents first, children in the engine's own order
    (`children(node)`), depth first: the order a snapshot lists them in."""
    stack: list[tuple[N, Optional[N]]] = [(root, None)]
    while stack:
        node, parent = stack.pop()
        yield node, parent
        stack.extend((child, node) for child in reversed(list(children(node))))


def _own_id(node: Any) -> int:
    return int(node.id)


class NodeHandles(Generic[N]):
    """Handles by a node's own id: every node handed out is remembered, and a handle not yet seen (read off a
    snapshot) is looked for with one more walk of the tree.

    `walk()` yields the tree's nodes (any order); `ident(node)` is the node's id, which the engine must never reuse
    for another node while the adapter lives (SGLang's and tinycache's ids count up)."""

    def __init__(self, walk: Callable[[], Iterable[N]], ident: Callable[[N], int] = lambda node: _own_id(node)) -> None:
        self._walk, self._ident = walk, ident
        self._nodes: dict[int, N] = {}

    def remember(self, node: N) -> int:
        """The handle of `node`, which resolves to it from now on."""
        handle = self._ident(node)
        self._nodes[handle] = node
        return handle

    def resolve(self, handle: int) -> N:
        """The node `handle` names; `StaleHandle` if no node with that id was ever in the tree."""
        node = self._nodes.get(handle)
        if node is None:
            for seen in self._walk():
                self.remember(seen)
            node = self._nodes.get(handle)
        if node is None:
            raise StaleHandle(f"no node with id {handle!r} was ever seen")
        return node

    @property
    def seen(self) -> Mapping[int, N]:
        """Every node remembered so far, by handle."""
        return self._nodes


def take_slots(slots: Optional[Sequence[Any]], asked: int, allocator: str) -> tuple[int, ...]:
    """An allocator's answer to a request for `asked` slots as the spec's: the slots as ints, or `PoolExhausted`
    where the engine's allocator says no room with None (SGLang's and tinycache's do)."""
    if slots is None:
        raise PoolExhausted(f"{allocator} returned None for {asked} slots")
    return tuple(int(s) for s in slots)
