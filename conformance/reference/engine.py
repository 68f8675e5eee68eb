"""A reference engine: kvcert's own scheduler around a protocol cache, as a request-path target (SPEC.md §12).

It is the positive control of the request-path harness: a scheduler written plainly, every decision the
textbook one, so that what `conformance.harness.requests` reports on a real engine is known to be the engine's. Its
scheduler is first-come first-served: a request is admitted when its whole final size (prompt and output,
less its cached prefix) fits after eviction in its scope, so a running request never stalls; it prefills in
chunks, decodes a token a step, and at its end caches the page-aligned part of what it computed, frees the
rest and drops its lock. A turn of an open session then registers the session on the node its insert ended
on; a close releases the session and keeps any turn of it still running from registering it again; a new
priority reaches the session and its turn in flight.

    kvcert certify kvcert.conformance.reference.engine:factory        # over the reference model
    kvcert certify kvcert.conformance.reference.engine:factory_gpu    # over kvcert.gpu
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Optional

from kvcert.conformance.backend import Model
from kvcert.spec import pages
from kvcert.spec.requests import RequestView, kv_namespace
from kvcert.spec.types import CacheConfig, Capabilities, Snapshot

__all__ = ["ReferenceEngine", "factory", "factory_gpu"]

CHUNK_PAGES = 2
"""Prefill chunk, in pages: a prompt longer than this takes several steps."""


@dataclass
class _Request:
    id: str
    session: Optional[str]
    namespace: Optional[str]
    tokens: list[int]
    prompt: int
    priority: int
    output: int
    state: str = "waiting"
    computed: int = 0
    target: int = 0
    """Tokens to prefill before the first sample: all it has when admitted."""
    row: list[int] = field(default_factory=list)
    """Its slots: the tree's for the matched prefix (`protected`), then its own for everything else."""
    protected: int = 0
    node: Optional[int] = None
    """The node its lock holds (the end of its matched prefix)."""


class ReferenceEngine:
    """A first-come first-served scheduler over any protocol cache (`RequestPathBackend`)."""

    def __init__(self, cache: Any, config: CacheConfig, priority_refs: Optional[bool] = None) -> None:
        """`priority_refs`: the cache keeps session refs (its factory's `Capabilities.priority_refs`); None reads
        them off the cache's own `capabilities`, where it carries them (the reference model's class does)."""
        self.cache, self.config = cache, config
        self.ps = config.page_size
        if priority_refs is None:
            priority_refs = bool(getattr(cache, "capabilities", None) and cache.capabilities.priority_refs)
        self.priority_refs = priority_refs
        self.model: Optional[Model] = None
        self.inbox: list[tuple[Any, ...]] = []
        self.waiting: list[_Request] = []
        self.running: list[_Request] = []
        self.ended: list[_Request] = []
        """Requests that finished or were aborted in the last step: reported once by `requests()`."""
        self.open: dict[str, int] = {}
        """Sessions whose turns register them, with the priority their client set last."""

    # ------------------------------------------------------------------ what clients send

    def set_clock(self, now: int) -> None:
        self.cache.set_clock(now)

    def attach_model(self, model: Model) -> None:
        self.model = model

    def submit(
        self,
        request: str,
        session: Optional[str],
        namespace: Optional[str],
        tokens: Sequence[int],
        priority: int,
        output: int,
        lora: Optional[tuple[str, str]] = None,
    ) -> None:
        """A request under a LoRA adapter is keyed, and computed, under its namespace with the adapter folded in
        (`kv_namespace`): the base model's pages and each adapter's never serve each other."""
        ns = kv_namespace(namespace, lora)
        self.inbox.append(("submit", request, session, ns, tuple(tokens), priority, output))

    def close_session(self, session: str) -> None:
        self.inbox.append(("close", session))

    def reprioritize(self, session: str, priority: int) -> None:
        self.inbox.append(("priority", session, priority))

    def abort(self, request: str) -> None:
        self.inbox.append(("abort", request))

    # ------------------------------------------------------------------ one scheduler iteration

    def step(self) -> None:
        self.ended = []
        for message in self.inbox:
            self._take(message)
        self.inbox = []
        self._settle()
        self._admit()
        self._loaded()
        for r in list(self.running):
            self._forward(r)
        self._settle()

    def _take(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "submit":
            _, rid, session, ns, tokens, priority, output = message
            self.waiting.append(_Request(rid, session, ns, list(tokens), len(tokens), priority, output))
            if session is not None:
                self.open[session] = priority  # a new turn reopens a closed session
        elif kind == "close":
            self.open.pop(message[1], None)
            self._release(message[1])
        elif kind == "priority":
            _, session, priority = message
            if session in self.open:
                self.open[session] = priority
                for r in self.waiting + self.running:
                    if r.session == session:
                        r.priority = priority
                if self.priority_refs and any(s.id == session for s in self.cache.snapshot().sessions):
                    self.cache.update_ref(session, priority)
        elif kind == "abort":
            for r in self.waiting + self.running:
                if r.id == message[1]:
                    self._end(r, "aborted")

    def _release(self, session: str) -> None:
        if self.priority_refs and any(s.id == session for s in self.cache.snapshot().sessions):
            self.cache.release_ref(session)

    def _scope(self, r: _Request) -> dict[str, bool]:
        if not self.priority_refs:
            return {}
        return {"allow_low": True, "allow_high": r.priority >= self.config.high_priority_threshold}

    def _free_tokens(self) -> int:
        return len(self.cache.snapshot().free_slots)

    def _admit(self) -> None:
        """First come, first served: each waiting request in turn, while its whole final size fits."""
        while self.waiting:
            r = self.waiting[0]
            cap = pages.page_floor(len(r.tokens) - 1, self.ps)  # at least one token is computed: the model samples
            got = self.cache.match_prefix(r.namespace, tuple(r.tokens[:cap]))
            self.cache.inc_lock_ref(got.node)
            final = len(r.tokens) + r.output - (len(r.tokens) - r.prompt)
            need = pages.page_ceil(final, self.ps) - got.length
            short = need - self._free_tokens()
            if short > 0:
                self.cache.evict(short, **self._scope(r))
            if need > self._free_tokens():
                self.cache.dec_lock_ref(got.node)
                return  # head of the line waits: nothing behind it goes first
            own = list(self.cache.alloc(need))
            self.waiting.pop(0)
            r.row, r.protected, r.node = list(got.slots) + own, got.length, got.node
            r.computed, r.target, r.state = got.length, len(r.tokens), "running"
            self.running.append(r)
            self._admitted(r)

    def _admitted(self, r: _Request) -> None:
        """A tier below the device may fill part of `r`'s own slots now (a direct linker: `engine_linker`)."""

    def _loaded(self) -> None:
        """What the tiers below filled this step has landed (or failed) before the forwards run."""

    def _forward(self, r: _Request) -> None:
        """One forward of `r`: a prefill chunk, or one decoded token; then it samples, or finishes."""
        assert self.model is not None, "attach_model first"
        upto = min(r.target, r.computed + CHUNK_PAGES * self.ps) if r.computed < r.target else r.computed + 1
        self._write(r, r.computed, upto)
        r.computed = upto
        if r.computed < r.target:
            return  # more prompt chunks to go
        if len(r.tokens) - r.prompt < r.output:
            r.tokens.append(self.model.next_token(r.namespace, tuple(r.tokens)))
        if len(r.tokens) - r.prompt >= r.output:
            self._end(r, "finished")

    def _write(self, r: _Request, start: int, end: int) -> None:
        if end > start and self.model is not None:
            self.cache.write_kv(r.row[start:end], self.model.kv(r.namespace, r.tokens, start, end - start))

    def _end(self, r: _Request, state: str) -> None:
        """A finished request caches the page-aligned part of what it computed; either way it frees the rest of its
        row, drops its lock, and a finished turn of an open session registers the session where its insert ended."""
        if r.state == "waiting":
            self.waiting.remove(r)
            r.state = state
            self.ended.append(r)
            return
        own_from = r.protected
        node = None
        if state == "finished":
            aligned = pages.page_floor(r.computed, self.ps)
            if aligned:
                out = self.cache.insert(r.namespace, tuple(r.tokens[:aligned]), tuple(r.row[:aligned]), r.priority)
                self.cache.free(r.row[r.protected : out.prefix_len])  # duplicates of what the tree held already
                own_from, node = max(aligned, r.protected), out.node
        self.cache.free(r.row[own_from:])
        self.cache.dec_lock_ref(r.node)
        self.running.remove(r)
        r.state = state
        self.ended.append(r)
        if node is not None and self.registers(r):
            self.register(r, node)
        if node is not None:
            self._cached(r, node)

    def _cached(self, r: _Request, node: int) -> None:
        """`r`'s computed pages are in the tree up to `node`: a tier below may copy them out now."""

    def registers(self, r: _Request) -> bool:
        """Whether a finished turn registers its session: it is a turn of a session still open."""
        return self.priority_refs and r.session is not None and r.session in self.open

    def register(self, r: _Request, node: int) -> None:
        """The session holds the path of its turn's cached tokens, at the priority its client set last."""
        assert r.session is not None
        self.cache.register_ref(r.session, node, self.open.get(r.session, r.priority))

    def _settle(self) -> None:
        """The copy engine keeps up: every copy a host tier issued lands, and its ack is taken."""
        if not self.config.host_capacity:
            return
        for _ in range(8):
            pending = self.cache.snapshot().pending
            if not pending:
                return
            for c in pending:
                if not c.finished:
                    self.cache.complete(c.id)
            self.cache.poll()

    # ------------------------------------------------------------------ what the suite reads

    def requests(self) -> tuple[RequestView, ...]:
        out = []
        for r in self.waiting + self.running + self.ended:
            own = r.row[r.protected :] if r.state == "running" else []
            out.append(
                RequestView(
                    r.id,
                    r.session,
                    r.namespace,
                    tuple(r.tokens),
                    r.prompt,
                    r.state,
                    r.priority,
                    r.computed if r.state == "running" else 0,
                    tuple(r.row) if r.state == "running" else (),
                    tuple(own),
                )
            )
        return tuple(out)

    def snapshot(self) -> Snapshot:
        lent = sorted(x for r in self.running for x in r.row[r.protected :])
        return replace(self.cache.snapshot(), lent_slots=tuple(lent))

    def bookkeeping(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        held = tuple(r.node for r in self.running if r.node is not None)
        return {
            "open sessions": (len(self.open), ()),
            "requests": (len(self.waiting) + len(self.running), held),
        }

    def read_kv(self, slots: Sequence[int]) -> list[bytes]:
        return list(self.cache.read_kv(slots))

    def read_host_kv(self, host_slots: Sequence[int]) -> list[bytes]:
        return list(self.cache.read_host_kv(host_slots))

    def close(self) -> None:
        close = getattr(self.cache, "close", None)
        if callable(close):
            close()


def _engine_over(make: Callable[[CacheConfig], Any], name: str) -> Callable[[CacheConfig], ReferenceEngine]:
    caps: Capabilities = make.capabilities  # type: ignore[attr-defined]

    def factory(config: CacheConfig) -> ReferenceEngine:
        return ReferenceEngine(make(config), config, caps.priority_refs)

    factory.capabilities = Capabilities(  # type: ignore[attr-defined]
        name=f"kvcert reference engine over {caps.name}",
        page_sizes=caps.page_sizes,
        policies=caps.policies,
        namespaces=caps.namespaces,
        strict_input=False,
        write_policies=caps.write_policies,
        kv_reads=True,
        priority_refs=caps.priority_refs,
        priority_parts=("high", "scope", "update"),
        profile="core",
        kind="request-path",
        loras=True,
        notes=(
            "first-come first-served; a request is admitted when its whole final size fits after eviction in its "
            f"scope; prefill in chunks of {CHUNK_PAGES} pages, one decoded token a step; every copy lands each step",
        ),
    )
    factory.__name__ = name
    return factory


def _variant(
    make: Callable[[CacheConfig], Any], name: str, engine: type[ReferenceEngine], suffix: str, note: str, **caps: Any
) -> Callable[[CacheConfig], Any]:
    """A factory of `engine` (a `ReferenceEngine` subclass: `engine_linker`'s, `engine_decode`'s) over `make`'s
    cache, its capabilities the reference engine's with `suffix` on the name, `note` among the notes and `caps`
    replaced."""
    base: Capabilities = _engine_over(make, name).capabilities  # type: ignore[attr-defined]

    def factory(config: CacheConfig) -> Any:
        return engine(make(config), config, base.priority_refs)

    factory.capabilities = replace(  # type: ignore[attr-defined]
        base, name=base.name + suffix, notes=base.notes + (note,), **caps
    )
    factory.__name__ = name
    return factory


def _refimpl(config: CacheConfig) -> Any:
    from kvcert.refimpl import RefCache

    return RefCache(config)


def _gpu(config: CacheConfig) -> Any:
    from kvcert.gpu import factory as gpu_factory

    return gpu_factory(config)


def _caps(module: str) -> Capabilities:
    if module == "refimpl":
        from kvcert.refimpl import RefCache

        return RefCache.capabilities
    from kvcert.gpu import CAPABILITIES

    return CAPABILITIES


_refimpl.capabilities = _caps("refimpl")  # type: ignore[attr-defined]
_gpu.capabilities = _caps("gpu")  # type: ignore[attr-defined]
factory = _engine_over(_refimpl, "factory")
"""`kvcert certify kvcert.conformance.reference.engine:factory`: the reference engine over the reference model."""
factory_gpu = _engine_over(_gpu, "factory_gpu")
"""`kvcert certify kvcert.conformance.reference.engine:factory_gpu`: the reference engine over kvcert.gpu."""
