"""Why RA-STARVE happens, shown on the fork's real server: play the finding's replay (its ten-conversation prelude,
then the eleventh), send the stuck low-priority turn again, and release every session's refs while it waits.

    .venv/bin/python scripts/ra_starve_probe.py        # about seven minutes on 2 cores (fresh servers)

Prints what the server holds refs for (sessions the client never closed, and sessions it closed whose refs came
back: the fork's Q2), whether the low-priority turn waits while the server idles, and whether the release admits it.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import requests

from kvcert.conformance.served.client import Ask, Reply
from kvcert.conformance.served.harness import Served
from kvcert.conformance.served.run import play_file
from kvcert.conformance.served.targets import TARGETS
from kvcert.conformance.served.traffic import Conversation

ROOT = Path(__file__).resolve().parent.parent
REPLAY = ROOT / "conformance/findings/served/RA-STARVE-low-priority-requests-wait-forever.json"


def main() -> None:
    body = json.loads(REPLAY.read_text())
    convs = [Conversation.from_json(c) for c in [*body["prelude"], body["conversation"]]]
    stuck = next(s for s in convs[-1].sessions if s.sid == "c010s05")
    turn = [t for t in stuck.turns if t.malformed is None][-1]
    sessions = [s for c in convs for s in c.sessions]
    logs = ROOT / "kvcert-failures" / "served" / "logs" / "ra-starve-probe"
    with Served(TARGETS["refaware"], int(body["seed"]), logs, None, env_extra=body.get("env") or None) as served:
        served.baseline, _ = served.idle()
        play_file(served, body)
        client = served.client
        assert client is not None and served.server is not None
        print(f"after the replay, idle: {client.occupancy()}")
        got: list[Reply] = []
        ask = Ask(rid="probe-low-a", session="probe", turn=0, prompt=tuple(turn.prompt or ()),
                  max_new_tokens=turn.max_new_tokens, priority=turn.priority)  # fmt: skip
        sender = threading.Thread(target=lambda: got.append(client.generate(ask)))
        start = time.monotonic()
        sender.start()
        time.sleep(20)
        print(f"c010s05's last turn (priority {turn.priority}, {len(ask.prompt)} prompt tokens, "
              f"{ask.max_new_tokens} out) sent again, 20 s later: answered={bool(got)} {client.occupancy()}")  # fmt: skip
        for s in sessions:
            r = requests.post(served.server.url + "/release_ref", json={"rid": s.sid}, timeout=30)
            msg = r.json().get("message", "")
            if msg.startswith("released"):
                kind = "closed by its client" if s.close else "never closed"
                prio = sorted({t.priority for t in s.turns if t.malformed is None}, key=str)
                print(f"  {s.sid} ({kind}, priorities {prio}): {msg}")
        sender.join(70)
        reply = got[0] if got else None
        waited = time.monotonic() - start
        print(f"after releasing every session: {reply.finish if reply else 'no answer'}, "
              f"{len(reply.output) if reply else 0} tokens, {waited:.1f} s after it was sent")  # fmt: skip


if __name__ == "__main__":
    main()
