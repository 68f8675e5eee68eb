"""`kvcert serve-certify` and `kvcert replay` of a served failure: the walk, the shrink, the replay file, the
certificate (SPEC.md §16).

A run starts the target's servers, checks the positive control, then plays conversation 0, 1, … of the seed,
judging each before the next. The first conversation that breaks a rule is shrunk — whole sessions dropped, then
trailing turns, then a turn's abort, cut or malformed request made plain — on the same servers with the cache
flushed between attempts (fresh servers after an exit), and the smallest one that still breaks the same rule is
saved as a replay file and replayed once on fresh servers. The certificate is the suite's own (`Certificate`),
one cell per target, `kind` "served".
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from importlib.resources import files
from pathlib import Path
from typing import Any, Optional

from kvcert.conformance.certification.certificate import CellResult, Certificate, FindingReplay
from kvcert.conformance.served import rules
from kvcert.conformance.served.harness import EnvironmentMissing, Played, Served, Verdict
from kvcert.conformance.served.server import ServerExited
from kvcert.conformance.served.targets import TARGETS, ServedTarget
from kvcert.conformance.served.traffic import MALFORMED, Conversation, Traffic, conversation

__all__ = ["SERVED_FORMAT", "EnvironmentMissing", "ServedRun", "play_file", "replay_file", "serve_certify", "traffic_of"]

SERVED_FORMAT = "kvcert-served-1"


def traffic_of(target: ServedTarget, exclude_malformed: tuple[str, ...] = ()) -> Traffic:
    """The target's traffic: its limits, and what its clients may send."""
    base = Traffic(vocab=512, context=target.context, pool_tokens=target.pool_tokens, block=target.block)
    kinds = tuple(k for k in MALFORMED if k not in exclude_malformed)
    return replace(base, malformed=kinds, **target.traffic)  # type: ignore[arg-type]


@dataclass
class ServedRun:
    """What a served certification did, conversation by conversation."""

    target: ServedTarget
    seed: int
    examples: int
    conversations: int = 0
    requests: int = 0
    seconds: float = 0.0
    counts: Counter[str] = field(default_factory=Counter)
    digests: list[str] = field(default_factory=list)
    failure: Optional[Verdict] = None
    replay_path: Optional[Path] = None
    minimal_requests: Optional[int] = None
    reproduced: Optional[bool] = None
    shrink_note: str = ""
    notes: list[str] = field(default_factory=list)
    not_checked: list[str] = field(default_factory=list)
    findings: list[FindingReplay] = field(default_factory=list)
    max_logprob_gap: float = 0.0
    played: list[Conversation] = field(default_factory=list)
    """The conversations played so far, with their prompts (a failure that needs them is saved after them)."""


@dataclass(frozen=True)
class ServedFinding:
    """A logged defect of a served engine (`findings/served/index.json`): its replay file, the targets it applies
    to, and the traffic it owns (a walk past it does not send that traffic; the replay does)."""

    id: str
    engine: str
    title: str
    user_sees: str
    upstream: str
    targets: tuple[str, ...]
    replay: str
    owns_malformed: tuple[str, ...] = ()
    owns_events: tuple[str, ...] = ()
    """Event-stream contradictions the finding explains ("sparse-block-stored"): the walk counts them instead of
    failing on them, and the finding reproduces when it sees any."""


def served_findings(target: Optional[str] = None) -> list[ServedFinding]:
    """The served findings log, or the entries that apply to `target`."""
    raw = json.loads(files("kvcert.conformance").joinpath("findings/served/index.json").read_text())
    out = [
        ServedFinding(
            id=e["id"],
            engine=e["engine"],
            title=e["title"],
            user_sees=e["user_sees"],
            upstream=e["upstream"],
            targets=tuple(e["targets"]),
            replay=e["replay"],
            owns_malformed=tuple(e.get("owns", {}).get("malformed", ())),
            owns_events=tuple(e.get("owns", {}).get("events", ())),
        )
        for e in raw
    ]
    return [f for f in out if target is None or target in f.targets]


def finding_path(f: ServedFinding) -> Path:
    return Path(str(files("kvcert.conformance").joinpath("findings", f.replay)))


def _save(
    path: Path,
    target: ServedTarget,
    served: Served,
    played: Played,
    verdict: Verdict,
    seed: int,
    prelude: tuple[Conversation, ...] = (),
) -> None:
    """A replay file: every prompt sent, and the conversations played before it where it needs them (`prelude`)."""
    body = {
        "format": SERVED_FORMAT,
        "target": target.name,
        "seed": seed,
        "model": {k: served.model.get(k) for k in ("digest", "spec")},
        "argv": served.argv,
        "env": served.env_extra,
        "rules": verdict.rules_broken(),
        "violations": [str(x) for x in verdict.violations[:20]],
        "prelude": [_sent(c).to_json() for c in prelude],
        "conversation": _sent(played.conversation).to_json(),
        "replay": f"kvcert replay {path}",
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(body, indent=1))


def _sent(conv: Conversation) -> Conversation:
    """`conv` with only the turns its clients sent (a client stops when the server is gone)."""
    sessions = tuple(replace(s, turns=tuple(t for t in s.turns if t.prompt is not None)) for s in conv.sessions)
    return replace(conv, sessions=tuple(s for s in sessions if s.turns))


def _attempt(served: Served, conv: Conversation, rule: str, fresh: bool) -> tuple[bool, Played, Verdict]:
    """Play `conv` on clean servers: fresh ones after a failing attempt (a failure may leave state no endpoint shows:
    the fork's tokenizer kept a stuck request's id), else the cache flushed where the server holds no request."""
    if fresh or not served.clean():
        served.restart()
    played = served.play(conv)
    verdict = served.judge_played(played, served.baseline)
    return rule in verdict.rules_broken(), played, verdict


def shrink(
    served: Served, played: Played, verdict: Verdict, budget: float, say: Callable[[str], None]
) -> tuple[Played, Verdict, str]:
    """The smallest conversation that still breaks the first broken rule, within `budget` seconds."""
    rule = verdict.rules_broken()[0]
    best, best_verdict = played, verdict
    deadline = time.monotonic() + budget

    def candidates(c: Conversation) -> list[Conversation]:
        out = [c.without(i) for i in reversed(range(len(c.sessions))) if len(c.sessions) > 1]
        for i, s in enumerate(c.sessions):
            for n in range(1, len(s.turns)):
                out.append(c.with_session(i, replace(s, turns=s.turns[:n])))
            for k in range(len(s.turns) - 1):  # a turn left out: later turns keep the prompts they were sent
                out.append(c.with_session(i, replace(s, turns=s.turns[:k] + s.turns[k + 1 :])))
            for k, t in enumerate(s.turns):
                if t.malformed or t.cut_after is not None or t.abort_after is not None:
                    plain = replace(t, malformed=None, cut_after=None, abort_after=None)
                    out.append(c.with_session(i, replace(s, turns=s.turns[:k] + (plain,) + s.turns[k + 1 :])))
            if s.close:
                out.append(c.with_session(i, replace(s, close=False)))
        return out

    improved = True
    tried = 0
    last_failed = True  # the walk's own failure came just before
    while improved and time.monotonic() < deadline:
        improved = False
        for cand in candidates(best.conversation):
            if time.monotonic() >= deadline:
                break
            tried += 1
            broke, p, v = _attempt(served, cand, rule, fresh=last_failed)
            last_failed = not v.passed
            if broke:
                best, best_verdict, improved = p, v, True
                say(f"    shrunk to {p.conversation.requests} requests in {len(p.conversation.sessions)} sessions")
                break
    note = "" if not improved else f"shrinking stopped at its {budget:.0f} s budget after {tried} attempts"
    return best, best_verdict, note


@dataclass(frozen=True)
class Options:
    """How a served run is set up (`serve_certify`'s keywords)."""

    out_dir: Path = Path("kvcert-failures")
    url: Optional[str] = None
    events: Optional[str] = None
    twin_url: Optional[str] = None
    python: Optional[str] = None
    extra_flags: tuple[str, ...] = ()
    shrink_seconds: float = 600.0
    env_extra: Optional[dict[str, str]] = None
    replay_check: bool = True
    known_findings: bool = True


def serve_certify(
    target_name: str, examples: int = 20, seed: int = 0, say: Callable[[str], None] = print, **options: Any
) -> tuple[Certificate, ServedRun]:
    """Certify a served target (SPEC.md §16): the certificate, and the run behind it. `options` are `Options`'s."""
    opts = Options(**options)
    target = TARGETS[target_name]
    run = ServedRun(target, seed, examples)
    if target.unavailable:
        raise ValueError(f"{target_name} cannot be served here: {target.unavailable}")
    t0 = time.monotonic()
    try:
        _walk(run, opts, say)
    except ServerExited as e:  # the server under test (or its twin) did not come up: nothing was served
        run.failure = Verdict([rules.Violation("INV-E2E-6", f"start-up: {e}")])
    if run.replay_path is not None and opts.url is None and opts.replay_check:
        say(f"  replaying {run.replay_path} on fresh servers")
        again = replay_file(run.replay_path, python=opts.python, say=lambda s: None, out_dir=opts.out_dir / "served")
        run.reproduced = bool(run.failure) and not again.passed and bool(
            set(again.rules_broken()) & set(run.failure.rules_broken() if run.failure else [])
        )
    run.seconds = time.monotonic() - t0
    return certificate(run, opts.url is not None, opts.twin_url is not None or opts.url is None), run


def _walk(run: ServedRun, opts: Options, say: Callable[[str], None]) -> None:
    target, seed = run.target, run.seed
    logs = opts.out_dir / "served" / "logs" / f"{target.name}-seed{seed}"
    with Served(
        target, seed, logs, opts.python, opts.url, opts.events, opts.twin_url, opts.extra_flags, env_extra=opts.env_extra
    ) as served:
        run.notes.append(f"started in {', '.join(f'{k} {v} s' for k, v in served.startups.items())}")
        if served.model:
            run.notes.append(f"model {Path(served.model['path']).name}, sha256 {served.model['digest'][:16]}")
        for name, argv in served.argv.items():
            run.notes.append(f"{name}: {' '.join(argv[1:])}")
        known = served_findings(target.name) if opts.url is None else []
        traffic = traffic_of(target, exclude_malformed=tuple(k for f in known for k in f.owns_malformed))
        if any("sparse-block-stored" in f.owns_events for f in known):
            served.judge.replay.tolerate_sparse = served.tolerate_sparse = True
        run.not_checked += _owned(known)
        served.baseline, _ = served.idle()  # before any traffic of kvcert's: what the engine holds after its warm-up
        control, control_played = served.positive_control()
        run.counts.update(control.counts)
        if not control.passed:
            run.failure = control
            path = opts.out_dir / "served" / f"{target.name}-seed{seed}-control.json"
            _save(path, target, served, control_played, control, seed)
            run.replay_path, run.minimal_requests = path, control_played.conversation.requests
        for i in range(run.examples):
            if run.failure is not None:
                break
            conv = conversation(seed, i, traffic)
            played = served.play(conv)
            verdict = served.judge_played(played, served.baseline)
            run.conversations += 1
            run.requests += played.conversation.requests
            run.counts.update(verdict.counts)
            run.max_logprob_gap = max(run.max_logprob_gap, verdict.max_logprob_gap)
            run.digests.append(played.digest())
            say(
                f"  conversation {i}: {len(conv.sessions)} sessions, {conv.requests} requests in {played.seconds:.1f} s"
                + ("" if verdict.passed else f"  FAIL {', '.join(verdict.rules_broken())}")
            )
            if not verdict.passed:
                for v in verdict.violations[:5]:
                    say(f"    {v}")
                small, small_verdict, note = played, verdict, "not shrunk (no budget)"
                prelude: tuple[Conversation, ...] = ()
                if opts.shrink_seconds > 0:
                    alone, _, _ = _attempt(served, played.conversation, verdict.rules_broken()[0], fresh=True)
                    if alone:
                        small, small_verdict, note = shrink(served, played, verdict, opts.shrink_seconds, say)
                    else:  # the state the earlier conversations left is part of the failure: keep them, unshrunk
                        prelude = tuple(run.played)
                        note = f"not shrunk: the conversation alone passes on fresh servers; saved after the {i} before it"
                        say(f"    {note}")
                run.shrink_note = note
                path = opts.out_dir / "served" / f"{target.name}-seed{seed}-c{i}.json"
                _save(path, target, served, small, small_verdict, seed, prelude)
                run.replay_path = path
                run.minimal_requests = small.conversation.requests + sum(c.requests for c in prelude)
                run.failure = small_verdict
            run.played.append(played.conversation)
        run.counts.update(_coverage(served))
        run.not_checked += _unexercised(run, target)
        if run.counts.get("tokens compared"):
            run.notes.append(
                f"largest logprob gap to the twin on an agreeing token: {run.max_logprob_gap:.2e} "
                f"(tolerance {rules.LOGPROB_TOL}); ties cut {run.counts.get('ties', 0)} comparisons"
            )
        for f in known if opts.known_findings else ():  # last: a known finding may take the server down
            run.findings.append(_replay_known(served, f, say))


def _owned(known: list[ServedFinding]) -> list[str]:
    """What the walk does not send or judge because a logged finding owns it (said under NOT CHECKED)."""
    out = []
    for f in known:
        if f.owns_events:
            out.append(
                f"event stores whose tokens span blocks they do not name ({', '.join(f.owns_events)}): known finding "
                f"{f.id} explains them; their blocks are not found by prompt (INV-E2E-4 judges the other groups')"
            )
        if f.owns_malformed:
            out.append(
                f"malformed requests ({', '.join(f.owns_malformed)}) in the walk: known finding {f.id} owns them "
                "(its replay sends them, after the walk)"
            )
    return out


def _replay_known(served: Served, f: ServedFinding, say: Callable[[str], None]) -> FindingReplay:
    """Replay a logged finding's conversation on the target's servers (fresh ones if the walk left them down)."""
    body = json.loads(finding_path(f).read_text())
    want = set(body.get("rules", ()))
    if body.get("prelude") or not served.clean():  # a prelude is played from a fresh server, as it was found
        served.restart()
    served.judge.replay.tolerate_sparse = False  # the finding's own replay is judged strictly
    verdict = play_file(served, body)
    served.judge.replay.tolerate_sparse = served.tolerate_sparse
    broke = sorted(want & set(verdict.rules_broken()))
    say(f"  known finding {f.id}: {'REPRODUCES' if broke else 'does not reproduce'} ({', '.join(broke) or 'no rule broken'})")
    summary = f"{f.title} — a user sees: {f.user_sees}"
    return FindingReplay(f.id, f.replay, bool(broke), broke, summary)


def _coverage(served: Served) -> Counter[str]:
    """What the run's event stream showed: blocks stored and removed per medium."""
    c: Counter[str] = Counter()
    for medium, n in served.judge.replay.stored.items():
        c[f"event:stored:{medium}"] = n
    for medium, n in served.judge.replay.removed.items():
        c[f"event:removed:{medium}"] = n
    if served.judge.replay.sparse:
        c["event:sparse stores"] = served.judge.replay.sparse
    return c


def _unexercised(run: ServedRun, target: ServedTarget) -> list[str]:
    """What the run was meant to reach and did not (said under NOT CHECKED)."""
    out = []
    removed = sum(v for k, v in run.counts.items() if k.startswith("event:removed:"))
    if not removed:
        out.append("eviction: no block was removed in this run (the pool never filled)")
    if target.write_policy and not run.counts.get("event:stored:CPU_PINNED"):
        out.append("the host tier: no block was announced stored on the host")
    if target.write_policy and not run.counts.get("cached from host>0"):
        out.append("load-back: no answer reported prompt tokens loaded back from the host")
    if not run.counts.get("cached>0"):
        out.append("prefix hits: no answer reported a cached prefix")
    if run.counts.get("ties"):
        out.append(f"{run.counts['ties']} answers compared only up to a tie of the twin's two best tokens")
    return out


def certificate(run: ServedRun, attached: bool, has_twin: bool) -> Certificate:
    t = run.target
    failure = None
    failures: list[dict[str, Any]] = []
    if run.failure is not None:
        failure = "\n".join(str(v) for v in run.failure.violations[:10])
        failures = [{"invariant": v.rule, "message": v.message, "step": None, "op": v.rid, "trace": None}
                    for v in run.failure.violations[:10]]  # fmt: skip
    digest = "" if not run.digests else hashlib.sha256("".join(run.digests).encode()).hexdigest()
    tier = f"served: {'device+host, ' + t.write_policy if t.write_policy else 'device'}"
    cell = CellResult(
        page_size=t.block,
        policy=t.policy,
        passed=run.failure is None and run.conversations == run.examples,
        examples=run.conversations,
        steps=run.requests,
        seconds=run.seconds,
        failure=failure,
        trace_path=str(run.replay_path) if run.replay_path else None,
        trace_len=run.minimal_requests,
        reproduced=run.reproduced,
        write_policy=t.write_policy,
        ops=dict(run.counts),
        tier=tier,
        digest=digest,
        failures=failures,
        shrink_note=run.shrink_note,
    )
    not_checked = list(t.not_checked) + run.not_checked
    if attached:
        not_checked = [f"attached to a server kvcert did not start ({t.engine} assumed): its log and processes"]
        not_checked += run.not_checked
    if not has_twin:
        not_checked.append("INV-E2E-1 same output: no twin server was given (--twin-url)")
    return Certificate(
        target=f"served:{t.name}",
        backend=t.summary,
        seed=run.seed,
        examples=run.examples,
        steps=0,
        strict_input=True,
        profile="served",
        cells=[cell],
        not_checked=not_checked,
        planned=[f"served {t.name}"],
        adapter_notes=run.notes,
        kind="served",
        findings=run.findings,
    )


def replay_file(
    path: Path,
    python: Optional[str] = None,
    say: Callable[[str], None] = print,
    out_dir: Optional[Path] = None,
    target_name: Optional[str] = None,
) -> Verdict:
    """Replay a saved served failure on fresh servers: the same requests, the same flags, judged the same way
    (on `target_name` instead of the file's target: another engine given the same conversation)."""
    body = json.loads(path.read_text())
    if body.get("format") != SERVED_FORMAT:
        raise ValueError(f"{path} is not a served replay file (format {body.get('format')!r})")
    target = TARGETS[target_name or body["target"]]
    logs = (out_dir or Path("kvcert-failures") / "served") / "logs" / f"replay-{target.name}-{path.stem}"
    with Served(target, int(body["seed"]), logs, python, env_extra=body.get("env") or None) as served:
        digest = served.model.get("digest")
        if body.get("model", {}).get("digest") not in (None, digest):
            say(f"  note: the model's digest differs from the saved one ({digest[:16] if digest else None})")
        served.baseline, _ = served.idle()
        verdict = play_file(served, body)
    for v in verdict.violations:
        say(f"  {v}")
    return verdict


def play_file(served: Served, body: dict[str, Any]) -> Verdict:
    """A replay file's conversation on `served`, after its prelude (played and judged as the walk did; only the last
    verdict is the file's)."""
    for before in body.get("prelude") or ():
        served.judge_played(served.play(Conversation.from_json(before)), served.baseline)
    return served.judge_played(served.play(Conversation.from_json(body["conversation"])), served.baseline)


def describe(target: ServedTarget) -> dict[str, Any]:
    """A target as `serve-certify --list` prints it."""
    return {k: v for k, v in asdict(target).items() if k in ("name", "summary", "engine", "venv", "install", "unavailable")}


RULE_TEXT = rules.RULES
