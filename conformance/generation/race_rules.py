"""The state machine's rule for race windows (`conformance.harness.windows`), mixed into `CacheMachine`.

Generation left to itself enters the in-flight windows real races live in only by luck: a split
needs a match that ends inside the edge of a node a copy is moving. This rule aims there, in the
host-tier cells: it cuts, at a page boundary, the edge of a node an unfinished copy moves (a match,
or an insert that diverges there), then often evicts from the host or the device while the copy
flies. (A write-back backup that finds the host full with no fault injected needs host pages nothing
can reclaim: the storage cells' small host, pinned by store copies and prefetches, gets there.)

The `readmit` rule, whose load-backs often stay in flight, locks the loading node before its ack or
splits it (`split_moving`) there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcert.conformance.generation.draws import Draws, draws, tokens_of
from kvcert.conformance.generation.runner import precondition, rule
from kvcert.spec.ops import Evict, EvictHost, Insert, Match

if TYPE_CHECKING:
    from kvcert.conformance.harness.driver import Harness
    from kvcert.spec.ops import Op
    from kvcert.spec.types import CacheConfig


class RaceRules:
    """Steps that enter race windows on purpose."""

    h: Harness
    config: CacheConfig

    def host(self) -> bool:  # pragma: no cover - the machine's
        raise NotImplementedError

    def on(self, rule: str) -> bool:  # pragma: no cover - the machine's
        raise NotImplementedError

    def do(self, op: Op) -> None:  # pragma: no cover - the machine's
        raise NotImplementedError

    def settle(self) -> None:  # pragma: no cover - the machine's
        raise NotImplementedError

    @precondition(lambda self: self.host() and self.on("race") and bool(self.h.open_copies()))
    @rule(data=draws())
    def race(self, data: Draws) -> None:
        """Split a node under an in-flight copy, and often evict around it while the copy flies."""
        self.split_moving(data, ("write", "load", "store"))

    def split_moving(self, data: Draws, kinds: tuple[str, ...]) -> None:
        """Cut the edge of a node an unfinished copy of one of `kinds` moves, then often evict around it."""
        ps = self.config.page_size
        edges = [e for e in self.h.moving_edges() if e[3] > ps and e[0] in kinds]
        if not edges:
            return
        _, ns, path, edge = data.choice(edges, "moving node")
        cut = len(path) - edge + ps * data.integer(1, edge // ps - 1, "pages into its edge")
        if data.boolean("diverge"):
            fork = tokens_of([data.integer(0, 3, "other page")], ps)
            self.do(Insert(ns, path[:cut] + fork))
        else:
            self.do(Match(ns, path[:cut]))
        then = data.integer(0, 2, "then")
        if then == 1:
            self.do(EvictHost(data.integer(1, 2 * ps, "host tokens")))
        elif then == 2:
            self.do(Evict(data.integer(1, 2 * ps, "tokens")))
