"""One engine server process: started with the engine's own entry point in a process group of its own, listening
on 127.0.0.1 only, and stopped with that whole group (its scheduler, detokenizer and workers too), also when the
run that started it fails.

`Server` is a context manager; `Attached` stands for a server someone else runs (`--url`): kvcert never stops it
and cannot read its log or its processes.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Protocol

import requests

__all__ = ["Attached", "Endpoint", "Server", "ServerExited", "free_port"]


class ServerExited(RuntimeError):
    """The server process is gone (its exit status and the end of its log say why)."""


class Endpoint(Protocol):
    """What a run needs of a server: where it listens, whether it is still up, and its log where kvcert has one."""

    @property
    def url(self) -> str: ...

    @property
    def name(self) -> str: ...

    def alive(self) -> bool: ...

    def exit_note(self) -> str: ...

    def log_text(self) -> str: ...


_HANDED_OUT: set[int] = set()


def free_port(rng: Optional[random.Random] = None) -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now, with the next few free too (engines take neighbours).

    Drawn below the kernel's ephemeral range (an outgoing connection of any process may take a port there between
    this check and the server's bind) and below SGLang's own draw for its NCCL port (22000-29999), and never one
    this process has handed out already (a server not yet bound to it looks free)."""
    pick = rng or random.Random()
    high = min(22000, _ephemeral_low()) - 8
    for _ in range(400):
        port = pick.randrange(12000, high, 8)
        if port not in _HANDED_OUT and all(_free(port + k) for k in range(8)):
            _HANDED_OUT.update(range(port, port + 8))
            return port
    raise RuntimeError("no free port range found on 127.0.0.1")


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@dataclass
class Server:
    """An engine server started from `argv` (its own entry point) with `env` added to the environment."""

    name: str
    argv: Sequence[str]
    port: int
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    ready_path: str = "/health"
    proc: Optional[subprocess.Popen[bytes]] = None
    started_at: float = 0.0
    ready_seconds: float = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **self.env}
        with open(self.log_path, "wb") as log:
            log.write(("$ " + " ".join(self.argv) + "\n").encode())
            log.flush()
            self.proc = subprocess.Popen(
                list(self.argv), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self.started_at = time.monotonic()

    def wait_ready(self, timeout: float = 300.0) -> None:
        """Until `ready_path` answers 200; `ServerExited` if the process dies first, TimeoutError past `timeout`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise ServerExited(f"{self.name} exited during start-up: {self.exit_note()}")
            try:
                if requests.get(self.url + self.ready_path, timeout=5).status_code == 200:
                    self.ready_seconds = time.monotonic() - self.started_at
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} not ready after {timeout:.0f} s (log: {self.log_path})")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def exit_note(self) -> str:
        code = None if self.proc is None else self.proc.poll()
        tail = "\n".join(self.log_text().splitlines()[-15:])
        return f"exit status {code}; last lines of {self.log_path}:\n{tail}"

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self, grace: float = 8.0) -> None:
        """SIGTERM to the whole process group, SIGKILL to whatever is left after `grace` seconds."""
        if self.proc is None:
            return
        pgid = self.proc.pid
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and _group_alive(pgid):
                time.sleep(0.2)
            if not _group_alive(pgid):
                break
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass

    def __enter__(self) -> Server:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class Attached:
    """A server kvcert did not start (`--url`): alive while it answers; no log, no process to stop."""

    url: str
    name: str = "attached"
    ready_path: str = "/health"
    patience: float = 60.0
    """Seconds a server may go on answering 5xx or nothing before it counts as exited: SGLang's /health waits on its
    scheduler and answers 503 while it is busy (a loaded machine), which is no exit. A refused connection is one."""

    def alive(self) -> bool:
        deadline = time.monotonic() + self.patience
        while True:
            try:
                if requests.get(self.url.rstrip("/") + self.ready_path, timeout=10).status_code < 500:
                    return True
            except requests.Timeout:
                pass
            except requests.ConnectionError:
                return False  # nothing listens there any more
            if time.monotonic() >= deadline:
                return False
            time.sleep(2.0)

    def exit_note(self) -> str:
        return f"{self.url} stopped answering {self.ready_path}"

    def log_text(self) -> str:
        return ""
