"""Ctrl-C stops `kvcert certify` (SIGINT sent to a real run): the partial certificate is written with
`complete: false`, the exit status is 130, and nothing prints CERTIFIED. Without the deferral, the interrupt
landed in Hypothesis's gc callback ("Exception ignored"), was lost, and the run went on to print CERTIFIED."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvcert.conformance.generation import interrupt


def test_sigint_stops_certify_with_a_partial_certificate_and_status_130(tmp_path: Path) -> None:
    cert_path = tmp_path / "cert.json"
    argv = [sys.executable, "-m", "kvcert.conformance.cli", "certify", "kvcert.gpu:factory", "--examples", "5000",
            "--device-only", "--json", str(cert_path), "--out", str(tmp_path / "failures")]  # fmt: skip
    run = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not cert_path.exists() and run.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)  # the certificate is first written before any cell runs
        time.sleep(3)  # into the first cell's walk (5000 examples: minutes, were it not stopped)
        run.send_signal(signal.SIGINT)
        out, _ = run.communicate(timeout=120)
    finally:
        run.kill()  # a run the interrupt did not stop is not left behind
    cert = json.loads(cert_path.read_text())
    assert run.returncode == 130, out[-2000:]
    assert cert["interrupted"] and not cert["complete"] and not cert["passed"]
    assert cert["finished_cells"] < cert["planned_cells"]
    assert not any(line.startswith("CERTIFIED") for line in out.splitlines()), out[-2000:]
    assert "incomplete (interrupted)" in out and "Exception ignored" not in out


def test_a_deferred_interrupt_is_raised_at_the_walks_next_step() -> None:
    with interrupt.sigint_deferred():
        interrupt.check()  # nothing pressed: no effect
        signal.raise_signal(signal.SIGINT)
        assert interrupt.interrupted()
        try:
            interrupt.check()
        except KeyboardInterrupt:
            pass
        else:
            raise AssertionError("check() did not raise after Ctrl-C")
    assert not interrupt.interrupted()  # the handler and the mark are gone with the context


def test_outside_the_cli_a_keyboard_interrupt_propagates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A library caller's own Ctrl-C (pytest's) is not turned into a partial certificate: only the CLI defers it."""
    from kvcert.conformance.certification.certify import certify
    from kvcert.conformance.generation.machine import CacheMachine

    def pressed(self: CacheMachine, op: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(CacheMachine, "do", pressed)
    with pytest.raises(KeyboardInterrupt):
        certify("kvcert.gpu:factory", examples=2, steps=5, page_sizes=[1], policies=["lru"], write_policies=[],
                prefetch_policies=[], out_dir=tmp_path)  # fmt: skip
