"""A served run's moving parts: the model, the servers (under test and its twin), the event stream, the client
sessions, and the judgment of one conversation (SPEC.md §16).

`Served` starts everything a target needs and stops all of it, process groups included, whatever happens;
`play` sends one conversation as its clients would; `judge` applies every end-to-end rule to what came back.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

import requests

from kvcert.conformance.served import rules
from kvcert.conformance.served.client import Ask, Client, Malformed, Reply, client_for
from kvcert.conformance.served.events import EventStream
from kvcert.conformance.served.server import Attached, Endpoint, Server, ServerExited, free_port
from kvcert.conformance.served.targets import ServedTarget, launch_argv, python_of
from kvcert.conformance.served.traffic import Conversation, Session, Turn, request_id

__all__ = ["Played", "Served", "Verdict", "make_model"]

LEAK = re.compile(r"memory leak detected", re.IGNORECASE)
"""What SGLang's own idle check logs when its pools do not add up (`InvariantChecker._report_leak`)."""
IDLE_TIMEOUT = 60.0


class EnvironmentMissing(RuntimeError):
    """The target's environment is not built; the message says which script builds it."""


def make_model(target: ServedTarget, python: Path, seed: int) -> dict[str, Any]:
    """The model made (or found) by the target's own interpreter: {"path", "digest", "spec"}."""
    if not python.exists():
        raise EnvironmentMissing(f"{python} does not exist: build the {target.engine} environment with `{target.install}`")
    run = subprocess.run(
        [str(python), "-m", "kvcert.conformance.served.model", "--seed", str(seed),
         "--sliding-window", str(target.sliding_window)],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=600,
        env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
    )
    if run.returncode != 0:
        raise EnvironmentMissing(f"making the model with {python} failed:\n{run.stderr[-2000:]}")
    return dict(json.loads(run.stdout.strip().splitlines()[-1]))


@dataclass
class Played:
    """One conversation as it went: what each client sent and got."""

    conversation: Conversation
    """The conversation with every turn's `prompt` filled in (a replay sends exactly these)."""
    replies: list[Reply] = field(default_factory=list)
    malformed: list[Malformed] = field(default_factory=list)
    closes: dict[str, int] = field(default_factory=dict)
    """Session -> the HTTP status of its close."""
    seconds: float = 0.0

    def digest(self) -> str:
        """SHA-256 of every request sent, in request-id order (the interleaving is the server's, not the seed's)."""
        h = hashlib.sha256()
        for s in self.conversation.sessions:
            for k, t in enumerate(s.turns):
                h.update(json.dumps([request_id(s, k), t.prompt, t.max_new_tokens, t.priority, s.key, t.malformed,
                                     t.cut_after, t.abort_after]).encode())  # fmt: skip
        return h.hexdigest()


@dataclass
class Verdict:
    violations: list[rules.Violation] = field(default_factory=list)
    counts: Counter[str] = field(default_factory=Counter)
    max_logprob_gap: float = 0.0
    """The largest gap between a served token's logprob and the twin's, over the tokens that agreed: how close to
    `rules.LOGPROB_TOL` float rounding came."""

    @property
    def passed(self) -> bool:
        return not self.violations

    def rules_broken(self) -> list[str]:
        return sorted({v.rule for v in self.violations})


def _served_model_name(url: str) -> str:
    try:
        got = requests.get(url.rstrip("/") + "/v1/models", timeout=30).json()
        return str(got["data"][0]["id"])
    except (requests.RequestException, ValueError, KeyError, IndexError) as e:
        raise ServerExited(f"{url}/v1/models does not name a model: {e}") from e


class Served:
    """The servers of one target: under test (with its event stream) and its twin; a context manager."""

    def __init__(
        self,
        target: ServedTarget,
        seed: int,
        logs: Path,
        python: Optional[str] = None,
        url: Optional[str] = None,
        events: Optional[str] = None,
        twin_url: Optional[str] = None,
        extra_flags: tuple[str, ...] = (),
        model_name: str = "",
        env_extra: Optional[dict[str, str]] = None,
    ) -> None:
        self.target, self.seed, self.logs = target, seed, logs
        self.python = python_of(target, python)
        self.url, self.events_addr, self.twin_url = url, events, twin_url
        self.extra_flags = extra_flags
        self.env_extra = dict(env_extra or {})
        """Added to the server under test's environment only (a planted bug, in tests)."""
        self.model: dict[str, Any] = {}
        self.model_name = model_name
        self.server: Optional[Endpoint] = None
        self.twin: Optional[Endpoint] = None
        self.stream: Optional[EventStream] = None
        self.client: Optional[Client] = None
        self.twin_client: Optional[Client] = None
        self.judge = rules.Judge(block=target.block)
        self.baseline: Optional[dict[str, float]] = None
        """The engine's occupancy before any of kvcert's traffic (INV-E2E-5 compares every idle reading with it)."""
        self.tolerate_sparse = False
        """Known finding VLLM-EV-SPARSE's stores are taken (set by the run; kept across restarts)."""
        self.twin_memo: dict[tuple[tuple[int, ...], int], Reply] = {}
        self._log_offset = 0
        self.startups: dict[str, float] = {}
        self._starts = 0
        """Servers started so far: each start logs to its own files (a restart keeps the failure's log)."""
        self.argv: dict[str, list[str]] = {}

    # -- lifecycle -----------------------------------------------------------------------------------------
    def __enter__(self) -> Served:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Start (or attach to) the servers. A server of kvcert's that exits at start-up because its port was taken
        between kvcert's choice and its bind (another process's outgoing connection) is started again on other
        ports, twice at most: that is kvcert's port choice, not the engine's behaviour."""
        for attempt in range(3):
            try:
                self._start()
                return
            except ServerExited:
                taken = [s for s in (self.server, self.twin) if isinstance(s, Server) and _port_taken(s)]
                if not taken or attempt == 2:
                    raise
                self.stop()

    def _start(self) -> None:
        t = self.target
        if self.url is None:
            self.model = make_model(t, self.python, self.seed)
        model_path = Path(self.model.get("path", ""))
        self._starts += 1
        n = "" if self._starts == 1 else f".{self._starts}"
        name = self.model_name or str(model_path)
        if self.url is not None:
            self.server = Attached(self.url, name="attached")
        else:
            port = free_port()
            ev = (f"tcp://127.0.0.1:{port + 4}", f"tcp://127.0.0.1:{port + 5}")
            self.stream = EventStream(ev[0], ev[1])
            argv, env = launch_argv(t, self.python, model_path, port, twin=False, events=ev, extra=self.extra_flags)
            self.argv["target"] = argv
            env.update(self.env_extra)
            self.server = Server(f"{t.name} server", argv, port, self.logs / f"{t.name}{n}.log", env)
        if self.events_addr is not None:  # "ADDR" or "ADDR,REPLAY_ADDR"
            endpoint, _, replay = self.events_addr.partition(",")
            self.stream = EventStream(endpoint, replay or None)
            self.judge.replay.synced = bool(replay)
        if self.twin_url is not None:
            self.twin = Attached(self.twin_url, name="twin")
        elif self.url is None:
            tport = free_port()
            argv, env = launch_argv(t, self.python, model_path, tport, twin=True)
            self.argv["twin"] = argv
            self.twin = Server(f"{t.name} twin (prefix caching off)", argv, tport, self.logs / f"{t.name}-twin{n}.log", env)
        for s in (self.twin, self.server):
            if isinstance(s, Server):
                s.start()
        for s in (self.server, self.twin):
            if isinstance(s, Server):
                s.wait_ready()
                self.startups[s.name] = round(s.ready_seconds, 1)
        if self.server is None or not self.server.alive():
            raise ServerExited(f"no server answers at {self.url}")
        if self.url is not None and not self.model_name and t.flavor == "openai":
            name = _served_model_name(self.url)  # an attached OpenAI server names its model at /v1/models
        kw = dict(model=name, vocab=512, context=t.context)
        self.client = client_for(t.flavor, self.server.url, **kw)  # type: ignore[arg-type]
        if self.twin is not None:
            self.twin_client = client_for(t.flavor, self.twin.url, **kw)  # type: ignore[arg-type]
        if self.stream is not None:
            self.stream.fill_gaps()
            if not self.judge.replay.synced and not self.client.flush():
                raise ServerExited(
                    f"{self.url}: joined its KV events without their replay socket, and the cache would not flush "
                    "(the flush's AllBlocksCleared is where the stream becomes known); pass --events ADDR,REPLAY_ADDR"
                )

    def stop(self) -> None:
        for s in (self.server, self.twin):
            if isinstance(s, Server):
                s.stop()
        if self.stream is not None:
            self.stream.close()
            self.stream = None

    def clean(self) -> bool:
        """Whether the server is up, holds no request, and its prefix cache was emptied now: a state a shrink
        attempt or a replay may start from."""
        if self.server is None or not self.server.alive() or self.client is None:
            return False
        occupancy = self.client.occupancy()
        if occupancy is not None and (occupancy["running"] or occupancy["waiting"]):
            return False
        return self.client.flush()

    def restart(self) -> None:
        """Fresh servers and a fresh event replay (after the server under test exited)."""
        self.stop()
        self.judge = rules.Judge(block=self.target.block)
        self.judge.replay.tolerate_sparse = self.tolerate_sparse
        self._log_offset = 0
        self.start()
        self.baseline, _ = self.idle()

    # -- traffic -------------------------------------------------------------------------------------------
    def play(self, conv: Conversation) -> Played:
        """Send `conv` as its clients would: one thread per session, each turn after its think time. A client sends
        its session id where the engine keeps sessions, names every turn by its session where the engine names a
        conversation by its request id (the fork), and announces a new priority first where the engine asks it to."""
        assert self.client is not None
        client = self.client
        traffic = self.target.traffic
        session_ids = bool(traffic.get("session_ids"))
        session_rid = bool(traffic.get("session_rid"))
        update_ref = bool(traffic.get("update_ref"))
        hints = bool(traffic.get("retain_hints"))
        played = Played(conv)
        lock = threading.Lock()
        filled: dict[int, Session] = {}
        t0 = time.monotonic()

        def run(i: int, s: Session) -> None:
            context: tuple[int, ...] = conv.systems[s.system] if s.system is not None else ()
            time.sleep(s.start)
            turns: list[Turn] = []
            priority: Optional[int] = None
            for k, turn in enumerate(s.turns):
                time.sleep(turn.think)
                if update_ref and k and turn.priority != priority and not turn.skip_update:
                    client.update_priority(s.sid, turn.priority)  # the fork's contract: a class change goes first
                priority = turn.priority
                prompt = turn.prompt if turn.prompt is not None else context + turn.new
                turns.append(replace(turn, prompt=prompt))
                if turn.malformed is not None:
                    m = client.malformed(turn.malformed, prompt)
                    with lock:
                        played.malformed.append(m)
                    if m.status == 0:
                        break  # the server is gone: this client stops
                    continue
                ask = Ask(
                    rid=s.sid if session_rid else request_id(s, k),
                    session=s.sid,
                    turn=k,
                    prompt=prompt,
                    max_new_tokens=turn.max_new_tokens,
                    priority=turn.priority,
                    key=s.key,
                    session_id=s.sid if session_ids else None,
                    cut_after=turn.cut_after,
                    abort_after=turn.abort_after,
                    retain=round(s.turns[k + 1].think + 1.0, 3) if hints and k + 1 < len(s.turns) else None,
                )
                reply = client.generate(ask)
                with lock:
                    played.replies.append(reply)
                if reply.status == 0 and reply.finish == "error":
                    break
                context = prompt + reply.output
            if s.close:
                status = client.close_session(s.sid)
                with lock:
                    played.closes[s.sid] = status
            with lock:
                filled[i] = replace(s, turns=tuple(turns) + s.turns[len(turns) :])

        with ThreadPoolExecutor(max_workers=max(1, len(conv.sessions))) as pool:
            for f in [pool.submit(run, i, s) for i, s in enumerate(conv.sessions)]:
                f.result()
        played.conversation = replace(conv, sessions=tuple(filled[i] for i in range(len(conv.sessions))))
        played.seconds = time.monotonic() - t0
        played.replies.sort(key=lambda r: (r.ask.session, r.ask.turn))
        return played

    def twin_answers(self, replies: Sequence[Reply]) -> list[Optional[Reply]]:
        """The twin's full answer to each reply's prompt, in order (memoized: the twin caches nothing, so one answer
        serves every request of that prompt and length)."""
        if self.twin_client is None:
            return [None] * len(replies)
        twin = self.twin_client
        want = {(r.ask.prompt, r.ask.max_new_tokens) for r in replies} - set(self.twin_memo)

        def ask(n: int, key: tuple[tuple[int, ...], int]) -> None:
            self.twin_memo[key] = twin.generate(Ask(f"twin{len(self.twin_memo) + n:07d}", "twin", 0, key[0], key[1]))

        with ThreadPoolExecutor(max_workers=4) as pool:
            list(pool.map(ask, range(len(want)), sorted(want)))
        return [self.twin_memo[(r.ask.prompt, r.ask.max_new_tokens)] for r in replies]

    def idle(self, timeout: float = IDLE_TIMEOUT) -> tuple[Optional[dict[str, float]], bool]:
        """The engine's occupancy once nothing is running or waiting (and whether that happened in `timeout`)."""
        assert self.client is not None
        deadline = time.monotonic() + timeout
        last: Optional[dict[str, float]] = None
        while time.monotonic() < deadline:
            last = self.client.occupancy()
            if last is None:
                return None, True
            if not last["running"] and not last["waiting"]:
                time.sleep(0.3)  # a close or a free lands just after the last answer
                again = self.client.occupancy()
                if again is not None and not again["running"] and not again["waiting"]:
                    return again, True
            time.sleep(0.2)
        return last, False

    def leak_lines(self) -> list[str]:
        """Lines the engine's own idle check logged since the last call."""
        if not isinstance(self.server, Server):
            return []
        text = self.server.log_text()
        new, self._log_offset = text[self._log_offset :], len(text)
        return [line.strip() for line in new.splitlines() if LEAK.search(line)]

    # -- judgment ------------------------------------------------------------------------------------------
    def judge_played(self, played: Played, baseline: Optional[dict[str, float]]) -> Verdict:
        """Every end-to-end rule on one conversation (SPEC.md §16.2)."""
        assert self.server is not None
        v = Verdict()
        alive = self.server.alive()
        for m in played.malformed:
            v.counts[f"malformed:{m.kind}"] += 1
            bad = rules.refused(m, alive)
            if bad:
                v.violations.append(bad)
        if not alive:
            v.violations.append(rules.Violation("INV-E2E-6", f"the server exited: {self.server.exit_note()}"))
            return v
        for r in played.replies:
            v.counts[f"request:{r.ask.intent}"] += 1
            v.counts["cached>0"] += bool(r.cached)
            v.counts["retracted"] += bool(r.retractions)
            v.counts["cached from host>0"] += bool(r.cached_host)
            v.counts[f"finish:{r.finish}"] += 1
            if r.ask.retain is not None:
                v.counts["retention hint sent"] += 1
            bad = rules.answered(r)
            if bad:
                v.violations.append(bad)
        for r, twin in zip(played.replies, self.twin_answers(played.replies)):
            if twin is None or r.status != 200:
                continue
            compared = rules.Compared()
            bad = rules.same_output(r, twin, compared)
            v.counts["tokens compared"] += compared.tokens
            v.max_logprob_gap = max(v.max_logprob_gap, compared.max_logprob_gap)
            v.counts["ties"] += compared.tie_at is not None
            if bad:
                v.violations.append(bad)
        occupancy, settled = self.idle()
        if not settled:
            v.violations.append(
                rules.Violation("INV-E2E-2", f"requests still running or waiting {IDLE_TIMEOUT:.0f} s after the last answer: {occupancy}")
            )
        elif occupancy is not None and baseline is not None and occupancy["used"] > baseline["used"]:
            v.violations.append(
                rules.Violation(
                    "INV-E2E-5",
                    f"idle with every session closed, the engine holds {occupancy['used']:g} (KV held by requests and "
                    f"sessions), its baseline is {baseline['used']:g}",
                )
            )
        for line in self.leak_lines():
            v.violations.append(rules.Violation("INV-E2E-5", f"the engine's idle check: {line[:300]}"))
        if self.stream is not None:
            self.stream.wait_quiet(quiet=rules.EVENT_QUIET, timeout=rules.EVENT_QUIET * 10)
            late = time.monotonic() + rules.EVENT_LATE
            while self.judge.unannounced(self.stream.batches(), played.replies) and time.monotonic() < late:
                self.stream.wait_quiet(quiet=rules.EVENT_QUIET, timeout=max(0.0, late - time.monotonic()))
            batches = self.stream.batches()
            for err in self.stream.errors:
                v.violations.append(rules.Violation("INV-E2E-3", err))
            self.stream.errors.clear()
            for err in self.stream.receiver_errors:  # kvcert's own side: no verdict on the engine from this run
                v.violations.append(rules.Violation("HARNESS", err))
            v.violations += self.judge.take(batches, played.replies)
        if not self.server.alive():
            v.violations.append(rules.Violation("INV-E2E-6", f"the server exited: {self.server.exit_note()}"))
        return v

    def positive_control(self) -> tuple[Verdict, Played]:
        """INV-E2E-4's positive control: a prompt sent twice, alone, with the pool empty enough: the second hits."""
        prompt = tuple(range(3, 3 + 4 * self.target.block + 5))
        turn = Turn(prompt, 4, 0.0, prompt=prompt)  # both turns send exactly this prompt
        session = Session(sid="ctl000s00", system=None, turns=(turn, replace(turn, think=0.3)), start=0.0)
        played = self.play(Conversation(seed=self.seed, index=-1, systems=(), sessions=(session,)))
        v = self.judge_played(played, None)
        second = played.replies[-1] if played.replies else None
        if second is None or not second.cached:
            got = None if second is None else second.cached
            v.violations.append(
                rules.Violation("INV-E2E-4", f"positive control: a prompt repeated alone reported {got} cached tokens")
            )
        elif self.stream is not None and self.judge.replay.held_prefix(second.ask.prompt, self.target.block) == 0:
            v.violations.append(
                rules.Violation("INV-E2E-4", "positive control: a prompt repeated alone hit, but no event announced its blocks")
            )
        return v, played


def _port_taken(server: Server) -> bool:
    """Whether `server` died at start-up because its listening port was in use."""
    return not server.alive() and "address already in use" in server.log_text().lower()
