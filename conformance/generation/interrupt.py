"""Ctrl-C that stops a run. Python delivers SIGINT as a KeyboardInterrupt wherever the main thread happens to be,
and Hypothesis runs a gc callback there often enough that the interrupt lands in it, is printed as "Exception
ignored" and lost, and the run goes on to print a verdict. Inside `sigint_deferred()` a first Ctrl-C only marks the
run interrupted; the walk raises KeyboardInterrupt at its next step (`check`), in its own code, where it
propagates. A second Ctrl-C raises at once."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Optional

__all__ = ["check", "interrupted", "sigint_deferred"]

_pending = threading.Event()


def interrupted() -> bool:
    """Whether Ctrl-C was pressed inside the current `sigint_deferred()`."""
    return _pending.is_set()


def check() -> None:
    """Raise KeyboardInterrupt if Ctrl-C was pressed: called by the walk between steps."""
    if _pending.is_set():
        raise KeyboardInterrupt("interrupted (Ctrl-C)")


@contextmanager
def sigint_deferred() -> Iterator[None]:
    """Defer Ctrl-C to the walk's next step for the duration (main thread only; elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_sigint(signum: int, frame: Optional[FrameType]) -> None:
        if _pending.is_set():
            raise KeyboardInterrupt("interrupted twice (Ctrl-C)")
        _pending.set()

    _pending.clear()  # before the handler is in place: a Ctrl-C from then on is kept
    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        _pending.clear()
