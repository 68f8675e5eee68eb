"""The HTTP client a served run plays: what a user's client sends, in the engine's own API.

Two flavors: SGLang's native `/generate` (SGLang and the RefAware fork: token ids in, token ids, logprobs and
`cached_tokens` out, `rid`, `session_id`, `priority`, `extra_key`, `cache_salt`, `/abort_request`,
`/close_session`, `/v1/loads`) and the OpenAI completions API as vLLM serves it (`prompt` as token ids,
`return_token_ids`, `logprobs`, `usage.prompt_tokens_details.cached_tokens`, `cache_salt`, `priority`,
`/metrics`). Every request asks for greedy decoding and the top two logprobs of every output token, so a
served answer can be compared with a twin's (`rules.same_output`).

A client that disconnects mid-stream reads `cut_after` streamed tokens and closes the connection; an abort is
the engine's abort call from a second thread. Nothing here judges anything: it records what came back.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any, Optional

import requests

from kvcert.conformance.served.traffic import malformed_body

__all__ = ["Ask", "Client", "OpenAIClient", "Reply", "SGLangClient", "client_for"]

TIMEOUT = 60.0
"""Seconds a client waits for an answer: a request to the tiny model takes a few seconds even on a busy CPU."""


@dataclass(frozen=True)
class Ask:
    """One request as the client means it."""

    rid: str
    session: str
    turn: int
    prompt: tuple[int, ...]
    max_new_tokens: int
    priority: Optional[int] = None
    key: Optional[tuple[str, str]] = None
    session_id: Optional[str] = None
    """Sent as the engine's session id (engines with sessions)."""
    cut_after: Optional[int] = None
    abort_after: Optional[float] = None
    stream: bool = False
    """Read the answer streamed even when reading it to the end (a benchmark times its first token)."""
    retain: Optional[float] = None
    """Seconds until the session's next turn, sent as kvcert's retention hint (`sampling_params.custom_params`)."""

    @property
    def intent(self) -> str:
        return "cut" if self.cut_after is not None else "abort" if self.abort_after is not None else "full"


@dataclass
class Reply:
    """What came back for one request."""

    ask: Ask
    status: int = 0
    """HTTP status; 0 when no response came (the connection failed)."""
    output: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()
    margins: tuple[Optional[float], ...] = ()
    """Per output token: the gap between the best and second-best logprob (None where unknown)."""
    cached: Optional[int] = None
    finish: str = ""
    """"length", "stop", "abort" (the engine ended it), "cut" (the client disconnected) or "error"."""
    error: str = ""
    cached_host: int = 0
    """Of the cached prompt tokens, those loaded back from the host tier (SGLang reports it; 0 elsewhere)."""
    retractions: int = 0
    """Times the engine retracted (preempted) the request to make room (SGLang reports it; 0 elsewhere)."""
    t_send: float = 0.0
    t_first: float = 0.0
    """When the first output token arrived (streamed requests only; 0.0 otherwise)."""
    t_end: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "rid": self.ask.rid,
            "status": self.status,
            "output": list(self.output),
            "cached": self.cached,
            "finish": self.finish,
            "error": self.error[:300],
        }


@dataclass
class Malformed:
    kind: str
    status: int = 0
    body: str = ""
    t_send: float = 0.0
    t_end: float = 0.0


def _margins(tops: list[list[float]]) -> tuple[Optional[float], ...]:
    out: list[Optional[float]] = []
    for values in tops:
        v = sorted((x for x in values if x is not None), reverse=True)
        out.append(v[0] - v[1] if len(v) >= 2 else None)
    return tuple(out)


@dataclass
class Client:
    """The common part: a base URL, a requests session per thread, and the flavor's calls."""

    url: str
    model: str = ""
    vocab: int = 512
    context: int = 1024
    _local: threading.local = field(default_factory=threading.local, repr=False)

    def _http(self) -> requests.Session:
        """A session per thread, one connection per request (`Connection: close`): a reused keep-alive connection
        the server closed while idle fails a request with no response, which would read as the engine's fault."""
        s = getattr(self._local, "s", None)
        if s is None:
            s = self._local.s = requests.Session()
            s.headers["Connection"] = "close"
        return s

    def generate(self, ask: Ask) -> Reply:
        """Send one request and read its answer; an abort (`ask.abort_after`) is sent from a timer while it is in
        flight, and never after: the client's next request may reuse the id (the fork names a conversation by it)."""
        reply = Reply(ask, t_send=time.monotonic())
        timer = threading.Timer(ask.abort_after, self.abort, args=(ask.rid,)) if ask.abort_after is not None else None
        try:
            if timer is not None:
                timer.start()
            if ask.cut_after is not None or ask.stream:
                self._stream(ask, reply)
            else:
                self._once(ask, reply)
        except requests.RequestException as e:
            reply.status, reply.finish, reply.error = reply.status or 0, "error", f"{type(e).__name__}: {e}"
        finally:
            if timer is not None:  # an abort already on its way lands before this returns
                timer.cancel()
                timer.join()
        reply.t_end = time.monotonic()
        return reply

    def malformed(self, kind: str, prompt: tuple[int, ...]) -> Malformed:
        how, body = malformed_body(kind, prompt, self.vocab, self.context)
        out = Malformed(kind, t_send=time.monotonic())
        data = body if how == "raw" else json.dumps(self._malformed_json(body))
        try:
            r = self._http().post(
                self.url + self.generate_path, data=data, headers={"Content-Type": "application/json"}, timeout=60
            )
            out.status, out.body = r.status_code, r.text[:300]
        except requests.RequestException as e:
            out.body = f"{type(e).__name__}: {e}"
        out.t_end = time.monotonic()
        return out

    def _sse(self, body: dict[str, Any], reply: Reply) -> Generator[dict[str, Any], None, None]:
        """The server-sent events of a streamed request, parsed, until `[DONE]` or until the caller stops reading
        (which closes the connection: a client that disconnects). A refused request yields nothing."""
        with self._http().post(self.url + self.generate_path, json=body, timeout=TIMEOUT, stream=True) as r:
            reply.status = r.status_code
            if r.status_code != 200:
                reply.finish, reply.error = "error", r.text[:300]
                return
            for line in r.iter_lines():
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    return
                yield json.loads(data)

    # the flavor's parts
    generate_path = ""

    def _once(self, ask: Ask, reply: Reply) -> None:
        raise NotImplementedError

    def _stream(self, ask: Ask, reply: Reply) -> None:
        raise NotImplementedError

    def _malformed_json(self, fields: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def abort(self, rid: str) -> None:
        """The engine's abort call for a request in flight (no-op where the engine has none)."""

    def close_session(self, sid: str) -> int:
        """The engine's session close; its HTTP status (0 where the engine has none)."""
        return 0

    def update_priority(self, sid: str, priority: Optional[int]) -> int:
        """The engine's call that moves a session to another priority (the fork's /update_ref); its HTTP status
        (0 where the engine has none)."""
        return 0

    def occupancy(self) -> Optional[dict[str, float]]:
        """The engine's live count of KV held by requests and sessions (not its evictable cache), and requests in
        flight: {"used": tokens, "running": n, "waiting": n}; None where the engine publishes none."""
        return None

    def flush(self) -> bool:
        """Empty the engine's prefix cache (between shrink attempts); whether it did."""
        return False


RETAIN_PARAM = "kvcert_retain_seconds"
"""The `custom_params` key kvcert's SGLang backend reads a retention hint from (docs/sglang-plugin.md, "Retention")."""


class SGLangClient(Client):
    generate_path = "/generate"

    def _body(self, ask: Ask, stream: bool) -> dict[str, Any]:
        body: dict[str, Any] = {
            "input_ids": list(ask.prompt),
            "sampling_params": {"max_new_tokens": ask.max_new_tokens, "temperature": 0.0},
            "return_logprob": True,
            "top_logprobs_num": 2,
            "rid": ask.rid,
            "stream": stream,
        }
        if ask.priority is not None:
            body["priority"] = ask.priority
        if ask.session_id is not None:
            body["session_id"] = ask.session_id
        if ask.key is not None:
            body[ask.key[0]] = ask.key[1]
        if ask.retain is not None:
            body["sampling_params"]["custom_params"] = {RETAIN_PARAM: ask.retain}
        return body

    def _take(self, j: dict[str, Any], reply: Reply) -> None:
        meta = j.get("meta_info") or {}
        reply.output = tuple(int(x) for x in j.get("output_ids") or ())
        reply.logprobs = tuple(float(x[0]) for x in meta.get("output_token_logprobs") or ())
        tops = [[float(a[0]) for a in t] if t else [] for t in meta.get("output_top_logprobs") or ()]
        reply.margins = _margins(tops)
        if meta.get("cached_tokens") is not None:
            reply.cached = int(meta["cached_tokens"])
        reply.retractions = int(meta.get("num_retractions") or meta.get("total_retractions") or 0)
        details = meta.get("cached_tokens_details") or {}
        reply.cached_host = int(details.get("host") or 0) if isinstance(details, dict) else 0
        fin = meta.get("finish_reason")
        kind = fin.get("type") if isinstance(fin, dict) else fin
        if kind in ("length", "stop"):
            reply.finish = kind
        elif kind == "abort":
            reply.finish = "abort"
            reply.error = str(fin.get("message", "")) if isinstance(fin, dict) else ""

    def _once(self, ask: Ask, reply: Reply) -> None:
        r = self._http().post(self.url + "/generate", json=self._body(ask, False), timeout=TIMEOUT)
        reply.status = r.status_code
        if r.status_code != 200:
            reply.finish, reply.error = "error", r.text[:300]
            return
        self._take(r.json(), reply)

    def _stream(self, ask: Ask, reply: Reply) -> None:
        with contextlib.closing(self._sse(self._body(ask, True), reply)) as chunks:
            for chunk in chunks:
                self._take(chunk, reply)  # SGLang streams the whole answer so far in each chunk
                if not reply.t_first and reply.output:
                    reply.t_first = time.monotonic()
                if ask.cut_after is not None and len(reply.output) >= ask.cut_after and not reply.finish:
                    reply.finish = "cut"
                    break  # leaving the block closes the connection: the client is gone
        if ask.cut_after is not None and not reply.finish and reply.status == 200:
            reply.finish = "cut"

    def _malformed_json(self, fields: dict[str, Any]) -> dict[str, Any]:
        sp: dict[str, Any] = {"max_new_tokens": fields["max_new_tokens"], "temperature": fields.get("temperature", 0.0)}
        return {"input_ids": fields["prompt"], "sampling_params": sp}

    def abort(self, rid: str) -> None:
        try:
            self._http().post(self.url + "/abort_request", json={"rid": rid}, timeout=30)
        except requests.RequestException:
            pass

    def close_session(self, sid: str) -> int:
        try:
            return self._http().post(self.url + "/close_session", json={"session_id": sid}, timeout=30).status_code
        except requests.RequestException:
            return 0

    def occupancy(self) -> Optional[dict[str, float]]:
        try:
            r = self._http().get(self.url + "/v1/loads", timeout=30)
            if r.status_code != 200:
                return None
            load = r.json()["loads"][0]
        except (requests.RequestException, ValueError, KeyError, IndexError):
            return None
        return {
            "used": float(load["num_used_tokens"]),
            "running": float(load["num_running_reqs"]),
            "waiting": float(load["num_waiting_reqs"]),
        }

    def flush(self) -> bool:
        try:
            return self._http().post(self.url + "/flush_cache", timeout=30).status_code == 200
        except requests.RequestException:
            return False


class RefAwareClient(SGLangClient):
    """The RefAware fork: SGLang's /generate, with a conversation named by its request id, closed by /release_ref
    and moved to another priority class by /update_ref."""

    def close_session(self, sid: str) -> int:
        try:
            return self._http().post(self.url + "/release_ref", json={"rid": sid}, timeout=30).status_code
        except requests.RequestException:
            return 0

    def update_priority(self, sid: str, priority: Optional[int]) -> int:
        try:
            body: dict[str, Any] = {"rid": sid, "new_priority": priority or 0}
            return self._http().post(self.url + "/update_ref", json=body, timeout=30).status_code
        except requests.RequestException:
            return 0


_METRIC = re.compile(r"^(vllm:[a-z_]+)(?:\{[^}]*\})?\s+([-+0-9.eE]+)$")


class OpenAIClient(Client):
    """vLLM's OpenAI-compatible server (`/v1/completions` with token-id prompts)."""

    generate_path = "/v1/completions"

    def _body(self, ask: Ask, stream: bool) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": list(ask.prompt),
            "max_tokens": ask.max_new_tokens,
            "temperature": 0.0,
            "logprobs": 2,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "stream": stream,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        if ask.priority is not None:
            body["priority"] = ask.priority
        if ask.key is not None:
            body[ask.key[0]] = ask.key[1]
        return body

    @staticmethod
    def _logprobs(lp: Optional[dict[str, Any]]) -> tuple[list[float], list[list[float]]]:
        if not lp:
            return [], []
        chosen = [float(x) for x in lp.get("token_logprobs") or () if x is not None]
        tops = [[float(v) for v in (t or {}).values()] for t in lp.get("top_logprobs") or ()]
        return chosen, tops

    def _once(self, ask: Ask, reply: Reply) -> None:
        r = self._http().post(self.url + "/v1/completions", json=self._body(ask, False), timeout=TIMEOUT)
        reply.status = r.status_code
        if r.status_code != 200:
            reply.finish, reply.error = "error", r.text[:300]
            return
        j = r.json()
        choice = j["choices"][0]
        reply.output = tuple(int(x) for x in choice.get("token_ids") or ())
        chosen, tops = self._logprobs(choice.get("logprobs"))
        reply.logprobs, reply.margins = tuple(chosen), _margins(tops)
        reply.finish = choice.get("finish_reason") or ""
        details = (j.get("usage") or {}).get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            reply.cached = int(details["cached_tokens"])

    def _stream(self, ask: Ask, reply: Reply) -> None:
        out: list[int] = []
        chosen: list[float] = []
        tops: list[list[float]] = []
        with contextlib.closing(self._sse(self._body(ask, True), reply)) as chunks:
            for j in chunks:  # vLLM streams each chunk's new tokens
                for choice in j.get("choices") or ():
                    out += [int(x) for x in choice.get("token_ids") or ()]
                    if not reply.t_first and out:
                        reply.t_first = time.monotonic()
                    c, t = self._logprobs(choice.get("logprobs"))
                    chosen += c
                    tops += t
                    if choice.get("finish_reason"):
                        reply.finish = choice["finish_reason"]
                details = (j.get("usage") or {}).get("prompt_tokens_details") or {}
                if details.get("cached_tokens") is not None:
                    reply.cached = int(details["cached_tokens"])
                if ask.cut_after is not None and len(out) >= ask.cut_after and not reply.finish:
                    reply.finish = "cut"
                    break
        reply.output, reply.logprobs, reply.margins = tuple(out), tuple(chosen), _margins(tops)
        if ask.cut_after is not None and not reply.finish and reply.status == 200:
            reply.finish = "cut"

    def _malformed_json(self, fields: dict[str, Any]) -> dict[str, Any]:
        body = {"model": self.model, "prompt": fields["prompt"], "max_tokens": fields["max_new_tokens"]}
        body["temperature"] = fields.get("temperature", 0.0)
        return body

    def _metrics(self) -> dict[str, float]:
        r = self._http().get(self.url + "/metrics", timeout=30)
        got: dict[str, float] = {}
        for line in r.text.splitlines():
            m = _METRIC.match(line)
            if m:
                got[m.group(1)] = got.get(m.group(1), 0.0) + float(m.group(2))
        return got

    def occupancy(self) -> Optional[dict[str, float]]:
        try:
            m = self._metrics()
        except requests.RequestException:
            return None
        if "vllm:kv_cache_usage_perc" not in m:
            return None
        return {
            "used": m["vllm:kv_cache_usage_perc"],
            "running": m.get("vllm:num_requests_running", 0.0),
            "waiting": m.get("vllm:num_requests_waiting", 0.0),
        }

    def flush(self) -> bool:
        try:
            return self._http().post(self.url + "/reset_prefix_cache", timeout=30).status_code == 200
        except requests.RequestException:
            return False


def client_for(flavor: str, url: str, **kw: Any) -> Client:
    if flavor == "sglang":
        return SGLangClient(url.rstrip("/"), **kw)
    if flavor == "openai":
        return OpenAIClient(url.rstrip("/"), **kw)
    if flavor == "refaware":
        return RefAwareClient(url.rstrip("/"), **kw)
    raise ValueError(f"unknown client flavor {flavor!r}")
