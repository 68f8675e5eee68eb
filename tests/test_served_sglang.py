"""SGLang 0.5.23 served as users deploy it (SPEC.md §16): its own server process on the model kvcert makes, driven
over HTTP and judged end to end — stock, and with kvcert's backend (`--radix-cache-backend kvcert`, priority
scheduling, sessions, host tier, metrics) — and three bugs planted in that backend, each failing the rule it breaks.

One caching-off twin serves every run of the module (the twin's flags are the same for both targets). Each run
starts its own server under test and stops its whole process group. With `KVCERT_SGLANG=1` (CI) SGLang is required.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from _sglang import require_sglang

require_sglang()

from kvcert.conformance.served.harness import make_model  # noqa: E402
from kvcert.conformance.served.run import serve_certify  # noqa: E402
from kvcert.conformance.served.server import Server, free_port  # noqa: E402
from kvcert.conformance.served.targets import TARGETS, launch_argv, python_of  # noqa: E402


@pytest.fixture(scope="module")
def twin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    target = TARGETS["sglang"]
    python = python_of(target)
    model = make_model(target, python, 0)
    port = free_port()
    argv, env = launch_argv(target, python, Path(model["path"]), port, twin=True)
    server = Server("sglang twin", argv, port, tmp_path_factory.mktemp("twin") / "twin.log", env)
    with server:
        server.wait_ready()
        yield server.url


def test_a_stock_sglang_server_someone_else_runs_is_certified_through_url_and_events(
    twin: str, tmp_path: Path
) -> None:
    """--url/--events/--twin-url: kvcert attaches to a server it did not start (here started by the test, SGLang's
    default cache, publishing KV events to an address kvcert binds). Without the replay socket kvcert flushes the
    cache and judges the stream from the flush's AllBlocksCleared on."""
    target = TARGETS["sglang"]
    python = python_of(target)
    model = make_model(target, python, 0)
    port = free_port()
    events = f"tcp://127.0.0.1:{free_port()}"
    argv, env = launch_argv(target, python, Path(model["path"]), port, twin=False, events=(events, f"{events}9"))
    argv[argv.index("--kv-events-config") + 1] = json.dumps({"publisher": "zmq", "endpoint": events})  # no replay
    with Server("user's sglang", argv, port, tmp_path / "user.log", env) as user:
        user.wait_ready()
        cert, run = serve_certify(
            "sglang", examples=2, out_dir=tmp_path, url=user.url, events=events, twin_url=twin, say=lambda s: None
        )
        assert user.alive()  # kvcert never stops a server it did not start
    cell = cert.cells[0]
    assert cell.passed, cell.failure
    assert run.conversations == 2 and run.counts["tokens compared"] > 100 and run.counts["cached>0"] > 0
    assert run.counts["event:stored:GPU"] > 0 and run.counts["event:removed:GPU"] > 0  # the pool filled and evicted
    assert cert.findings == [] and any("attached" in g for g in cert.not_checked)


def test_kvcerts_backend_serves_with_priorities_sessions_its_host_tier_and_metrics(twin: str, tmp_path: Path) -> None:
    """The options a user turns on first: --enable-metrics with the host tier used to exit the scheduler."""
    cert, run = serve_certify(
        "sglang-kvcert", examples=2, out_dir=tmp_path, twin_url=twin, shrink_seconds=0, say=lambda s: None
    )
    assert cert.cells[0].passed, cert.cells[0].failure
    assert run.counts["event:stored:CPU_PINNED"] > 0 and run.counts["request:full"] > 0
    (oov,) = cert.findings  # SGLang's own, reached the same way with kvcert's cache: the walk went past it
    assert oov.id == "SG-OOV" and oov.reproduced and oov.rules == ["INV-E2E-6"]
    assert not cert.passed and cert.kind == "served" and any("SGLang on a CPU" in g for g in cert.not_checked)


PLANTS = [
    ("match-one-page-off", "INV-E2E-1"),
    ("leak-lock", "INV-E2E-5"),
    ("drop-store-event", "INV-E2E-3"),
]


@pytest.mark.parametrize(("plant", "rule"), PLANTS, ids=[p for p, _ in PLANTS])
def test_a_bug_planted_in_the_backend_fails_the_rule_it_breaks(plant: str, rule: str, twin: str, tmp_path: Path) -> None:
    cert, run = serve_certify(
        "sglang-kvcert",
        examples=2,
        out_dir=tmp_path,
        twin_url=twin,
        shrink_seconds=0,
        say=lambda s: None,
        env_extra={"KVCERT_SERVED_PLANT": plant},
        replay_check=False,
        known_findings=False,
    )
    assert run.failure is not None and rule in run.failure.rules_broken(), run.failure
    assert not cert.cells[0].passed and run.replay_path is not None and run.replay_path.exists()
