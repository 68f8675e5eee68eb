"""The state machine's rule for running requests (SPEC.md §4.8), mixed into `CacheMachine`.

One rule, not four, so that the other rules keep their share of the steps: a run with no request
running starts one; otherwise it starts another (at most `MAX_RUNNING`), decodes, checkpoints or
finishes one. Prompts come from the same keys as inserts (`draw_key`), so a request's checkpoint
lands on cached prefixes, splits nodes another request locks, and frees duplicates.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from kvcert.conformance.generation.draws import Draws, draws, sampled_from, tokens_of
from kvcert.conformance.generation.runner import precondition, rule
from kvcert.spec.ops import Checkpoint, Extend, Finish, Start

if TYPE_CHECKING:
    from kvcert.conformance.harness.driver import Harness
    from kvcert.spec.ops import Op
    from kvcert.spec.types import CacheConfig

MAX_RUNNING = 3
"""Requests running at once: each holds its own pages, and a 6-page device has few to lend."""


class RunningRules:
    """Requests that hold KV across operations: start, decode, checkpoint, finish."""

    h: Harness
    config: CacheConfig

    def on(self, rule: str) -> bool:  # pragma: no cover - the machine's
        raise NotImplementedError

    def do(self, op: Op) -> None:  # pragma: no cover - the machine's
        raise NotImplementedError

    def draw_key(self, data: Draws, remember: bool) -> tuple[Optional[str], list[int]]:  # pragma: no cover
        raise NotImplementedError

    def make_room(self, tokens: int) -> None:  # pragma: no cover - the machine's
        raise NotImplementedError

    @precondition(lambda self: self.on("requests"))
    @rule(data=draws(), action=sampled_from(["start", "decode", "decode", "checkpoint", "finish"]))
    def running(self, data: Draws, action: str) -> None:
        """A request is admitted (its prompt often ending mid-page), decodes, caches what it has so far while it
        keeps running, or ends, caching its KV or not."""
        ps = self.config.page_size
        live = self.h.running_requests()
        if not live or (action == "start" and len(live) < MAX_RUNNING):
            ns, codes = self.draw_key(data, remember=True)
            tokens = tokens_of(codes, ps, data.integer(0, ps - 1, "prompt's partial page"))
            if not tokens:
                tokens = tokens_of([data.integer(0, 3, "one page")], ps)
            short = len(tokens) - self.h.free_tokens()
            if short > 0 and data.boolean("make room"):
                self.make_room(len(tokens))
            self.do(Start(ns, tokens, data.integer(0, 2, "priority")))
            return
        k = data.choice(live, "request")
        if action == "decode" or action == "start":
            decoded = tokens_of(data.codes(1, 2, "decoded pages"), ps)
            self.do(Extend(k, decoded[: data.integer(1, len(decoded), "decoded tokens")]))
        elif action == "checkpoint":
            self.do(Checkpoint(k))
        else:
            self.do(Finish(k, data.boolean("cache it")))
