"""A trace replayed on a fresh backend beside the oracle: what broke, what was bad input, which race windows each
step entered. Certification replays every failure it reports, every corpus trace and every shrink candidate
(`certify`), and every logged finding (`known`); `kvcert replay` and the tests replay saved traces."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Optional

from kvcert.conformance.backend import Factory
from kvcert.conformance.harness.driver import ConformanceFailure, Harness
from kvcert.conformance.harness.requests import RequestHarness
from kvcert.conformance.harness.running import TraceInvalid
from kvcert.spec.ops import Op, Trace
from kvcert.spec.types import CacheConfig, Capabilities


@dataclass
class Replay:
    """A trace replayed on a fresh backend beside the oracle."""

    failure: Optional[ConformanceFailure]
    """The first broken rule, or None: the trace passes (or no caller could play it: `invalid`)."""
    rejected: list[int] = field(default_factory=list)
    """Steps the oracle rejected as bad input, up to where the replay stopped."""
    invalid: str = ""
    """Why no caller could play the trace (`TraceInvalid`), or ""."""
    windows: list[tuple[int, str]] = field(default_factory=list)
    """(step, race window) for each window a step entered (`conformance.harness.windows`), with `replay(windows=True)`."""

    def valid_failure(self) -> bool:
        """It fails, and on valid traffic: no step up to the failing one was bad input."""
        return self.failure is not None and not any(i <= self.failure.step for i in self.rejected)


def replay(
    factory: Factory, capabilities: Capabilities, config: CacheConfig, ops: Sequence[Op], windows: bool = False
) -> Replay:
    """Run `ops` on a fresh backend beside the oracle, then quiesce; what broke, what was bad input, and with
    `windows` the race windows each step entered."""
    h: Optional[Harness | RequestHarness] = None
    entered: list[tuple[int, str]] = []
    try:
        make = RequestHarness if capabilities.kind == "request-path" else Harness
        h = make(factory(config), config, capabilities)
        h.count_windows = windows
        for i, op in enumerate(ops):
            h.step(op)
            entered += [(i, w) for w in h.windows]
        h.quiesce()
    except ConformanceFailure as failure:
        entered += [(failure.step, w) for w in (h.windows if h is not None else [])]
        return Replay(failure, list(h.rejected) if h is not None else [], windows=entered)
    except TraceInvalid as invalid:  # a shrink candidate no caller could play: not a failure of the backend
        return Replay(None, list(h.rejected) if h is not None else [], str(invalid), entered)
    finally:
        if h is not None:
            h.close()
    return Replay(None, list(h.rejected), windows=entered)


def replay_failure(
    factory: Factory, capabilities: Capabilities, config: CacheConfig, ops: list[Op]
) -> Optional[ConformanceFailure]:
    """Run `ops` on a fresh backend; the failure, or None if the trace passes."""
    return replay(factory, capabilities, config, ops).failure


def replay_fails(factory: Factory, capabilities: Capabilities, trace: Trace) -> bool:
    return replay_failure(factory, judged_as(capabilities, trace), trace.config, list(trace.ops)) is not None


def judged_as(capabilities: Capabilities, trace: Trace) -> Capabilities:
    """The capabilities to replay `trace` with: the backend's, under the profile the trace was judged by."""
    return replace(capabilities, profile=trace.profile) if trace.profile else capabilities
