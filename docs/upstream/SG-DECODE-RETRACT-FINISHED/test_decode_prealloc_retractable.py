"""A request that finished in the last decode iteration is not retractable.

pop_preallocated() keeps room for the running batch: the tokens of its requests are counted as retractable, so a new
request is admitted when its prompt plus its output, less those, fits. The running batch still lists the requests
that finished in the last iteration (they leave it at the next batch filter), and their KV is already in the radix
tree, unlocked: counted as evictable room by the same budget. Counting it twice admits a long-output request on room
that the preallocation then takes, and the request is aborted by retract_decode ("Out of memory even after
retracting all other requests in the decode batch", HTTP 500) while the transfer admitted beside it holds the pool.

Run: python -m pytest -q test_decode_prealloc_retractable.py  (fails on SGLang 0.5.23; passes with fix.patch)
"""

import unittest
from types import SimpleNamespace
from unittest.mock import MagicMock

from sglang.srt.disaggregation.decode import DecodePreallocQueue
from sglang.srt.managers.schedule_batch import FINISH_LENGTH


def _req(rid, prompt, output, finished):
    return SimpleNamespace(
        rid=rid,
        origin_input_ids=[1] * prompt,
        output_ids=[2] * output,
        finished=lambda: finished,
        finished_reason=FINISH_LENGTH(length=output) if finished else None,
    )


class TestDecodePreallocRetractable(unittest.TestCase):
    def _queue(self, running):
        queue = DecodePreallocQueue.__new__(DecodePreallocQueue)
        queue.queue = []
        queue.pending_reqs = []
        queue.pp_size = 1
        queue.retracted_queue = []
        queue._resolve_pending_reqs = MagicMock()
        queue._update_handshake_waiters = MagicMock()
        queue._uses_swa_tail_prealloc = MagicMock(return_value=False)
        queue._uses_swa_reservation = MagicMock(return_value=False)
        queue._allocatable_token_budgets = MagicMock(return_value=0)
        queue._hicache_pending_restore_tokens = MagicMock(return_value=0)
        scheduler = MagicMock()
        scheduler.running_batch.reqs = running
        scheduler.enable_priority_scheduling = False
        scheduler.enable_hisparse = False
        scheduler.enable_lora = False
        queue.scheduler = scheduler
        return queue

    def test_finished_request_is_not_counted_retractable(self):
        decoding = _req("decoding", prompt=100, output=20, finished=False)
        finished = _req("finished", prompt=1098, output=2, finished=True)
        queue = self._queue([decoding, finished])

        queue.pop_preallocated()

        # Only the request still decoding can be retracted to make room; the finished one's KV is in the tree
        # already, where the budget counts it as evictable.
        retractable = queue._allocatable_token_budgets.call_args.kwargs["retractable_tokens"]
        self.assertEqual(retractable, 120)


if __name__ == "__main__":
    unittest.main()
