"""The served targets' own parts, without a server: the event replay a router would do, the end-to-end rules, the
traffic a seed draws, the model kvcert makes, and the ZMQ stream with its replay socket (SPEC.md §16).

Each rule is shown to fail on the input that breaks it and to pass on the input that does not; the servers
themselves are in tests/test_served_sglang.py and tests/test_served_vllm.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import pytest
import zmq

from kvcert.conformance.served import rules
from kvcert.conformance.served.client import Ask, Malformed, Reply
from kvcert.conformance.served.events import END_SEQ, Batch, BlockReplay, EventStream, decode_batch, replay_all
from kvcert.conformance.served.run import SERVED_FORMAT, finding_path, served_findings, traffic_of
from kvcert.conformance.served.server import free_port
from kvcert.conformance.served.targets import TARGETS, launch_argv
from kvcert.conformance.served.traffic import MALFORMED, Conversation, conversation, request_id

ROOT = Path(__file__).resolve().parent.parent


def stored(hashes: list[int], parent: int | None, tokens: list[int], size: int = 2, medium: str = "GPU") -> dict:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": size, "medium": medium}  # fmt: skip


def removed(hashes: list[int], medium: str = "GPU") -> dict:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}


def batches(*events: list[dict]) -> list[Batch]:
    return [Batch(i, float(i), tuple(evs)) for i, evs in enumerate(events)]


# ------------------------------------------------------------------ the event replay (INV-E2E-3)


def test_a_consistent_stream_replays_to_what_a_router_holds() -> None:
    replay, bad = replay_all(
        batches(
            [stored([1, 2], None, [5, 6, 7, 8])],
            [stored([3], 2, [9, 10]), stored([1], None, [5, 6], medium="CPU_PINNED")],
            [removed([2]), {"type": "AllBlocksCleared"}],
        )
    )
    assert bad == []
    assert replay.held == {} and replay.cleared == 1 and replay.stored["GPU"] == 3 and replay.removed["GPU"] == 1


@pytest.mark.parametrize(
    ("events", "why"),
    [
        ([[stored([1], None, [5, 6])], [removed([9])]], "never left held"),
        ([[stored([2], 7, [5, 6])]], "never stored"),
        ([[stored([1, 2], None, [5, 6])]], "carries 2 tokens"),
        ([[stored([1], None, [5, 6])], [removed([1], medium="CPU_PINNED")]], "never left held there"),
    ],
    ids=["removal-not-held", "parent-never-stored", "tokens-for-blocks", "removal-other-medium"],
)
def test_a_stream_that_contradicts_itself_breaks_inv_e2e_3(events: list[list[dict]], why: str) -> None:
    _, bad = replay_all(batches(*events))
    assert bad and why in bad[0]


def test_a_sequence_gap_and_a_late_start_break_inv_e2e_3() -> None:
    replay = BlockReplay()
    assert "first" in replay.apply(Batch(3, 0.0, ()))[0]
    assert replay.apply(Batch(4, 0.0, ())) == []
    assert "after 4" in replay.apply(Batch(6, 0.0, ()))[0]


def test_a_block_held_twice_is_removed_twice() -> None:
    """vLLM may cache one hash in two blocks (a recomputed last block): a multiset, not a set."""
    _, bad = replay_all(batches([stored([1], None, [5, 6]), stored([1], None, [5, 6])], [removed([1])], [removed([1])]))
    assert bad == []
    _, bad = replay_all(batches([stored([1], None, [5, 6])], [removed([1])], [removed([1])]))
    assert bad and "never left held" in bad[0]


def test_sparse_stores_are_a_contradiction_unless_a_known_finding_explains_them() -> None:
    sparse = batches([stored([1], None, [5, 6, 7, 8])])
    assert replay_all(sparse)[1]
    replay = BlockReplay(tolerate_sparse=True)
    assert replay.apply(sparse[0]) == [] and replay.sparse == 1 and replay.holds(1)
    assert replay.held_prefix([5, 6, 7, 8], 2) == 0  # its tokens cannot be placed: nothing found by prompt


def test_held_prefix_follows_the_chain_of_held_blocks_on_any_medium() -> None:
    replay, _ = replay_all(
        batches([stored([1, 2], None, [5, 6, 7, 8])], [stored([3], 2, [9, 10], medium="CPU_PINNED")], [removed([2])])
    )
    assert replay.held_prefix([5, 6, 7, 8, 9, 10, 11], 2) == 2  # block 2 gone: the chain stops after block 1
    replay.apply(Batch(3, 3.0, (stored([2], 1, [7, 8]),)))
    assert replay.held_prefix([5, 6, 7, 8, 9, 10, 11], 2) == 6  # the host's block 3 counts
    assert replay.held_prefix([5, 6, 0, 0], 2) == 2


def test_both_engines_wire_formats_decode() -> None:
    body = msgspec.msgpack.encode([1.5, [stored([1], None, [5, 6]), {"type": "AllBlocksCleared"}], 0])
    assert [e["type"] for e in decode_batch(0, 0.0, body).events] == ["BlockStored", "AllBlocksCleared"]
    positional = msgspec.msgpack.encode([1.5, [["BlockRemoved", [4], "GPU"]], None])
    assert decode_batch(1, 0.0, positional).events[0] == {"type": "BlockRemoved", "block_hashes": [4], "medium": "GPU"}


def test_ports_are_drawn_below_the_ephemeral_range_and_never_twice() -> None:
    """A port in the ephemeral range can be taken by any process's outgoing connection before the server binds it
    (a start-up that failed with "address already in use"), and two servers started together must not share one."""
    from kvcert.conformance.served.server import _ephemeral_low

    ports = [free_port() for _ in range(40)]
    assert all(12000 <= p and p + 8 <= min(22000, _ephemeral_low()) for p in ports)
    assert len({p // 8 for p in ports}) == len(ports)


def test_only_a_start_up_that_lost_its_port_is_started_again(tmp_path: Path) -> None:
    from kvcert.conformance.served.harness import _port_taken
    from kvcert.conformance.served.server import Server

    lost, crashed = (Server(n, ["true"], free_port(), tmp_path / f"{n}.log") for n in ("lost", "crashed"))
    lost.log_path.write_text("ERROR:    [Errno 98] error while attempting to bind on address: address already in use\n")
    crashed.log_path.write_text("RuntimeError: Host pool not found\n")
    assert _port_taken(lost) and not _port_taken(crashed)


def test_the_stream_binds_receives_and_fills_what_it_missed_from_the_replay_socket() -> None:
    """A publisher that sent batch 0 before the subscriber was there: the replay socket hands it over."""
    port = free_port()
    pub_addr, rep_addr = f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}"
    payloads = [msgspec.msgpack.encode([0.0, [stored([i + 1], i or None, [i, i])], 0]) for i in range(3)]
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(rep_addr)
    stream = EventStream(pub_addr, rep_addr)
    pub = ctx.socket(zmq.PUB)
    pub.connect(pub_addr)
    time.sleep(0.5)  # the subscription reaches the publisher
    for seq in (1, 2):
        pub.send_multipart([b"", seq.to_bytes(8, "big"), payloads[seq]])

    def serve_replay() -> None:  # SGLang 0.5.23's replay frames: [id, "", topic, seq, payload], then END_SEQ
        ident, _, start = router.recv_multipart()
        for seq in range(int.from_bytes(start, "big"), 3):
            router.send_multipart([ident, b"", b"", seq.to_bytes(8, "big"), payloads[seq]])
        router.send_multipart([ident, b"", b"", END_SEQ, b""])

    server = threading.Thread(target=serve_replay)
    server.start()
    stream.wait_quiet(quiet=0.3, timeout=5)
    try:
        assert stream.fill_gaps() == 1
        got = stream.batches()
        assert [b.seq for b in got] == [0, 1, 2] and not stream.errors
        assert replay_all(got)[1] == []
    finally:
        server.join(timeout=5)
        stream.close()
        pub.close(linger=0)
        router.close(linger=0)
        ctx.term()


# ------------------------------------------------------------------ the rules on recorded replies


def reply(tokens: list[int], lps: list[float], margins: list[float] | None = None, **kw: object) -> Reply:
    ask = Ask("r1", "s", 0, (3, 4, 5), len(tokens))
    r = Reply(ask, status=200, output=tuple(tokens), logprobs=tuple(lps), finish="length")
    r.margins = tuple(margins if margins is not None else [1.0] * len(tokens))
    for k, v in kw.items():
        setattr(r, k, v)
    return r


def test_same_output_passes_equal_answers_and_names_the_first_wrong_token() -> None:
    twin = reply([7, 8, 9], [-0.1, -0.2, -0.3])
    assert rules.same_output(reply([7, 8, 9], [-0.1, -0.2, -0.3]), twin) is None
    bad = rules.same_output(reply([7, 5, 9], [-0.1, -0.9, -0.3], cached=2), twin)
    assert bad is not None and bad.rule == "INV-E2E-1" and "token 1" in bad.message and "2 prompt tokens" in bad.message
    bad = rules.same_output(reply([7, 8, 9], [-0.1, -0.5, -0.3]), twin)
    assert bad is not None and "logprob" in bad.message  # the right token from the wrong KV still shows


def test_same_output_stops_at_a_tie_of_the_twins_two_best_tokens() -> None:
    twin = reply([7, 8, 9], [-0.1, -0.69, -0.3], margins=[1.0, 0.001, 1.0])
    compared = rules.Compared()
    assert rules.same_output(reply([7, 4, 0], [-0.1, -0.69, -2.0]), twin, compared) is None
    assert compared.tie_at == 1 and compared.tokens == 1


def test_a_streamed_cut_is_compared_as_a_prefix_and_a_short_full_answer_fails() -> None:
    twin = reply([7, 8, 9], [-0.1, -0.2, -0.3])
    cut = reply([7, 8], [-0.1, -0.2], finish="cut")
    assert rules.same_output(cut, twin) is None
    short = reply([7, 8], [-0.1, -0.2])
    assert rules.same_output(short, twin) is not None


def test_answered_and_refused() -> None:
    ok = reply([7], [-0.1])
    assert rules.answered(ok) is None
    assert rules.answered(reply([7], [-0.1], finish="abort")).rule == "INV-E2E-2"  # type: ignore[union-attr]
    assert rules.answered(reply([], [], status=500, error="boom")) is not None
    assert rules.refused(Malformed("bad-json", status=400), True) is None
    assert "exited" in str(rules.refused(Malformed("bad-json", status=0), False))
    assert rules.refused(Malformed("bad-json", status=500), True) is not None
    assert rules.refused(Malformed("bad-json", status=200), True) is not None


def test_cached_tokens_above_what_the_events_held_in_flight_break_inv_e2e_4() -> None:
    judge = rules.Judge(block=2)
    stream = [Batch(0, 1.0, (stored([1, 2], None, [3, 4, 5, 6]),)), Batch(1, 50.0, (removed([1, 2]),))]
    honest = reply([7], [-0.1], cached=2, t_send=2.0, t_end=3.0)
    liar = reply([7], [-0.1], cached=4, t_send=2.0, t_end=3.0)
    liar.ask = Ask("r2", "s", 0, (3, 4, 9, 9), 1)
    found = judge.take(stream, [honest, liar])
    assert [v.rule for v in found] == ["INV-E2E-4"] and "r2" in found[0].message and judge.hits_seen == 2


def test_a_block_announced_after_the_answer_counts_and_one_removed_before_the_send_does_not() -> None:
    """An engine may announce late (SGLang publishes every 40th decode step): the window runs to the end of the idle
    server's stream. A block the stream removed before the send, and never stored again, was not there to hit."""
    late = Batch(0, 30.0, (stored([1], None, [3, 4]),))
    r = reply([7], [-0.1], cached=2, t_send=2.0, t_end=3.0)
    assert rules.Judge(block=2).take([late], [r]) == []
    gone = [Batch(0, 0.5, (stored([1], None, [3, 4]),)), Batch(1, 1.0, (removed([1]),))]
    found = rules.Judge(block=2).take(gone, [reply([7], [-0.1], cached=2, t_send=2.0, t_end=3.0)])
    assert [v.rule for v in found] == ["INV-E2E-4"]


def test_the_harness_can_ask_whether_a_hit_is_unannounced_without_judging() -> None:
    """`unannounced` is the harness's reason to wait for late batches: it answers on a copy, so the judge applies
    nothing, and the same stream judged after the late batch arrived has nothing to report."""
    judge = rules.Judge(block=2)
    r = reply([7], [-0.1], cached=2, t_send=2.0, t_end=3.0)
    assert judge.unannounced([], [r]) and judge.applied == 0 and judge.hits_seen == 0
    late = [Batch(0, 30.0, (stored([1], None, [3, 4]),))]
    assert not judge.unannounced(late, [r]) and judge.applied == 0
    assert judge.take(late, [r]) == [] and judge.applied == 1


def test_a_quiet_wait_counts_from_the_call_not_from_the_last_batch() -> None:
    """An empty stream, or one whose last batch is old, is not taken as drained at once: a publisher that has not
    sent yet gets `quiet` seconds from the call."""
    addr = f"tcp://127.0.0.1:{free_port()}"
    stream = EventStream(addr)
    try:
        t0 = time.monotonic()
        stream.wait_quiet(quiet=0.3, timeout=5)
        assert 0.3 <= time.monotonic() - t0 < 2
    finally:
        stream.close()


# ------------------------------------------------------------------ traffic, targets, findings


def test_the_same_seed_draws_the_same_conversations_in_any_process() -> None:
    t = traffic_of(TARGETS["sglang-kvcert"])
    here = [conversation(7, i, t).to_json() for i in range(3)]
    code = (
        "import json; from kvcert.conformance.served.run import traffic_of; from kvcert.conformance.served.targets "
        "import TARGETS; from kvcert.conformance.served.traffic import conversation; "
        "t = traffic_of(TARGETS['sglang-kvcert']); print(json.dumps([conversation(7, i, t).to_json() for i in range(3)]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONHASHSEED": "123"})  # fmt: skip
    assert json.loads(out.stdout) == json.loads(json.dumps(here))
    assert conversation(8, 0, t).to_json() != here[0]
    back = Conversation.from_json(json.loads(json.dumps(here[0])))
    assert back.to_json() == here[0]


def test_traffic_reaches_what_the_rules_need_and_stays_inside_the_engines_limits() -> None:
    t = traffic_of(TARGETS["sglang-kvcert"])
    convs = [conversation(0, i, t) for i in range(100)]
    turns = [tu for c in convs for s in c.sessions for tu in s.turns]
    assert sum(tu.abort_after is not None for tu in turns) and sum(tu.cut_after is not None for tu in turns)
    assert {tu.malformed for tu in turns} - {None} == set(MALFORMED)
    assert len({tu.priority for tu in turns}) == 3 and any(s.key for c in convs for s in c.sessions)
    assert any(len(c.sessions) > 4 for c in convs) and any(s.close for c in convs for s in c.sessions)
    for c in convs:
        for s in c.sessions:
            used = len(c.systems[s.system]) if s.system is not None else 0
            used += sum(len(tu.new) + tu.max_new_tokens for tu in s.turns if tu.malformed is None)
            assert used <= t.pool_tokens // 2
    ids = [request_id(s, k) for c in convs for s in c.sessions for k in range(len(s.turns))]
    assert len(set(map(len, ids))) == 1 and len(set(ids)) == len(ids)  # no id extends another (SG-ABORT not sent)
    excluded = traffic_of(TARGETS["sglang"], exclude_malformed=("prompt-id-out-of-vocab",))
    kinds = {tu.malformed for i in range(40) for s in conversation(0, i, excluded).sessions for tu in s.turns}
    assert "prompt-id-out-of-vocab" not in kinds


def test_every_target_serves_on_loopback_with_a_caching_off_twin() -> None:
    for name, t in TARGETS.items():
        if t.unavailable:
            assert "CPU" in t.unavailable, name
            continue
        argv, env = launch_argv(t, Path("python"), Path("/m"), 1234, twin=False, events=("tcp://a", "tcp://b"))
        twin, _ = launch_argv(t, Path("python"), Path("/m"), 1235, twin=True)
        assert "127.0.0.1" in argv and "--kv-events-config" in argv and "--kv-events-config" not in twin, name
        assert set(t.twin_flags) <= set(twin) and not set(t.flags) & (set(twin) - set(argv)), name
        assert any(f in twin for f in ("--disable-radix-cache", "--no-enable-prefix-caching")), name
        assert t.not_checked, name


def test_a_retention_hint_travels_in_custom_params_only_to_the_target_that_takes_it() -> None:
    """sglang-kvcert-retain's server runs with KVCERT_RETENTION=1 and its clients send hints; a request without a
    hint carries no custom_params, so every other target's requests are as before."""
    from kvcert.conformance.served.client import RETAIN_PARAM, SGLangClient

    retain = TARGETS["sglang-kvcert-retain"]
    assert ("KVCERT_RETENTION", "1") in retain.env and traffic_of(retain).retain_hints
    assert not any(traffic_of(t).retain_hints for n, t in TARGETS.items() if n != "sglang-kvcert-retain")
    client = SGLangClient("http://127.0.0.1:1")
    plain = client._body(Ask("r", "s", 0, (3, 4), 2), stream=False)
    hinted = client._body(Ask("r", "s", 0, (3, 4), 2, retain=2.5), stream=False)
    assert "custom_params" not in plain["sampling_params"]
    assert hinted["sampling_params"]["custom_params"] == {RETAIN_PARAM: 2.5}


def test_every_logged_served_finding_has_a_replay_file_for_a_target_that_exists() -> None:
    for f in served_findings():
        body = json.loads(finding_path(f).read_text())
        assert body["format"] == SERVED_FORMAT and body["rules"] and f.targets, f.id
        assert all(t in TARGETS for t in f.targets) and body["target"] in f.targets, f.id
        conv = Conversation.from_json(body["conversation"])
        assert conv.requests >= 1 and all(tu.prompt is not None for s in conv.sessions for tu in s.turns), f.id
        assert set(f.owns_malformed) <= set(MALFORMED), f.id


def test_the_model_is_the_same_bytes_from_the_same_seed(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from kvcert.conformance.served.model import ModelSpec, ensure_model

    a, da = ensure_model(ModelSpec(seed=3), tmp_path / "a")
    b, db = ensure_model(ModelSpec(seed=3), tmp_path / "b")
    assert da == db and a.name == b.name
    assert ensure_model(ModelSpec(seed=3), tmp_path / "a") == (a, da)  # found, not made again
    _, other = ensure_model(ModelSpec(seed=4), tmp_path / "a")
    assert other != da
    config = json.loads((a / "config.json").read_text())
    assert config["num_hidden_layers"] == 2 and config["hidden_size"] == 128


def test_an_attached_server_busy_answering_503_is_not_an_exit_and_a_refused_port_is() -> None:
    """INV-E2E-6 on `--url`: SGLang's /health answers 503 while its scheduler is busy (a loaded machine); that is no
    exit while the server answers again within `patience`. A port nothing listens on is an exit at once."""
    import http.server
    import threading
    import time as _time

    from kvcert.conformance.served.server import Attached, free_port

    answers = iter([503, 503, 200])

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            self.send_response(next(answers, 200))
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    port = free_port()
    httpd = http.server.HTTPServer(("127.0.0.1", port), Health)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        assert Attached(f"http://127.0.0.1:{port}", patience=30).alive()
    finally:
        httpd.shutdown()
        httpd.server_close()
    start = _time.monotonic()
    assert not Attached(f"http://127.0.0.1:{free_port()}", patience=30).alive()
    assert _time.monotonic() - start < 5
