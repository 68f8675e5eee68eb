"""Where cells run: in this process, in K spawned processes (`--jobs`), or as tasks on a Ray cluster (`--ray`).

A cell's result depends on its seed, config and target only, never on the process that ran it, so every
placement gives the same certificate (the step digests say so). `map_ordered` hands the results back in
call order whatever order the workers finish in, so the certificate's cell order is fixed too.

Ray (`pip install -r requirements/ray.txt`): `--ray local` starts a cluster on this machine for the run and
stops it after; any other value is a cluster address (`ray start --head` prints one; `auto` finds a running
one) whose every node has kvcert and the target importable at the same version. Each cell is one task of
one CPU.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

__all__ = ["Call", "RayUnavailable", "map_ordered"]

T = TypeVar("T")

Call = tuple[tuple[Any, ...], dict[str, Any]]
"""One call's positional and keyword arguments (picklable: they cross a process boundary)."""


class RayUnavailable(RuntimeError):
    """`--ray` was asked for and Ray cannot be imported, or has no cluster at the address given."""


def map_ordered(fn: Callable[..., T], calls: Sequence[Call], *, jobs: int = 1, ray: str | None = None) -> Iterator[T]:
    """`fn(*args, **kwargs)` for each call, yielded in call order. `fn` is a module-level function (workers import
    it by name). Closing the iterator early (a fail-fast stop) cancels what has not run."""
    if ray is not None:
        return _on_ray(fn, calls, ray)
    if jobs > 1 and len(calls) > 1:
        return _on_pool(fn, calls, min(jobs, len(calls)))
    return (fn(*args, **kwargs) for args, kwargs in calls)


def _on_pool(fn: Callable[..., T], calls: Sequence[Call], workers: int) -> Iterator[T]:
    # spawned, not forked: a worker starts from a clean interpreter, as a Ray worker does
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        pending = [pool.apply_async(fn, args, kwargs) for args, kwargs in calls]
        for p in pending:
            yield p.get()


def _on_ray(fn: Callable[..., T], calls: Sequence[Call], address: str) -> Iterator[T]:
    try:
        import ray as ray_
    except ImportError as e:
        raise RayUnavailable("--ray needs Ray on this machine: pip install -r requirements/ray.txt") from e
    started = not ray_.is_initialized()
    if started:
        try:
            ray_.init(address=address, include_dashboard=False, log_to_driver=False)
        except (ConnectionError, ValueError) as e:  # no cluster at that address, or not an address
            raise RayUnavailable(f"--ray {address}: {e}") from e
    refs: list[Any] = []
    try:
        task = ray_.remote(num_cpus=1, max_retries=0)(fn)  # a cell that dies is an error, not a rerun
        refs = [task.remote(*args, **kwargs) for args, kwargs in calls]
        for ref in refs:
            yield ray_.get(ref)
    finally:
        done, _ = ray_.wait(refs, num_returns=len(refs), timeout=0) if refs else ([], [])
        for ref in refs:
            if ref not in done:
                ray_.cancel(ref, force=True)
        if started:
            ray_.shutdown()
