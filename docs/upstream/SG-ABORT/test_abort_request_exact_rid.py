"""An abort of one request aborts every request whose id starts with its id.

Scheduler.abort_request matches `req.rid.startswith(recv_req.rid)` in the chunked request, the waiting queue, the
running batch and the PD queues (and GrammarManager.abort_requests, the EPD receiver and the dLLM queue do the same).
The tokenizer manager forwards an abort only for a rid it tracks, one request's full id; a client that chooses its
own ids (`rid` in /generate) and aborts "job-1", or whose connection to "job-1" drops, also aborts "job-10",
"job-11", ... of other clients: they end with FINISH_ABORT although nobody asked.

Run: python -m pytest -q test_abort_request_exact_rid.py  (fails on SGLang 0.5.23; passes with fix.patch)
"""

import unittest
from types import SimpleNamespace
from unittest.mock import MagicMock, patch

from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.managers.io_struct import AbortReq
from sglang.srt.managers.scheduler import Scheduler


class _Req:
    """What abort_request reads of a Req in the waiting queue or the running batch."""

    def __init__(self, rid):
        self.rid = rid
        self.to_finish = None
        self.kv = SimpleNamespace(holds_mamba=False, holds_kv=False)

    def finished(self):
        return False


@patch("sglang.srt.managers.scheduler._make_abort_req", MagicMock())
class TestAbortRequestExactRid(unittest.TestCase):
    def _scheduler(self, waiting, running):
        sched = Scheduler.__new__(Scheduler)
        sched.chunked_req = None
        sched.mm_receiver = None
        sched.dllm_config = None
        sched.waiting_queue = list(waiting)
        sched.disaggregation_mode = DisaggregationMode.NULL
        sched.grammar_manager = MagicMock()
        sched.beam_coordinator = MagicMock()
        sched._release_aborted_request = MagicMock()
        sched.send_abort_output = MagicMock()
        sched.collect_inflight_reqs = MagicMock(return_value=set(running))
        return sched

    def test_abort_leaves_requests_whose_id_extends_it(self):
        queued, queued_other = _Req("job-1"), _Req("job-10")
        running, running_other = _Req("chat-7"), _Req("chat-7b")
        sched = self._scheduler([queued, queued_other], [running, running_other])

        sched.abort_request(AbortReq(rid="job-1"))
        sched.abort_request(AbortReq(rid="chat-7"))

        self.assertEqual([r.rid for r in sched.waiting_queue], ["job-10"])
        self.assertIsNotNone(running.to_finish)
        self.assertIsNone(running_other.to_finish, "chat-7b was aborted by the abort of chat-7")

    def test_abort_all_still_aborts_everything(self):
        sched = self._scheduler([_Req("a"), _Req("b")], [])
        sched.abort_request(AbortReq(abort_all=True))
        self.assertEqual(sched.waiting_queue, [])


if __name__ == "__main__":
    unittest.main()
