"""Multi-rank agreement: every tensor-parallel rank consumes the same acks and pages.

Each rank of a tensor-parallel group runs its own cache over its own shard of the KV, and
its copies finish at their own pace (or fail and are retried on one rank only). The tree
must nevertheless stay identical on every rank, so the decisions that depend on copy
progress are agreed: each rank proposes what it has locally (finished acks at the head of a
queue, pages fetched from storage) and all take the minimum, as SGLang's `writing_check`,
`loading_check` and `check_prefetch_progress` do with `all_reduce(op=MIN)` over the TP group.

`Agreement` is the single-process default (the local value is the decision);
`GroupAgreement` does the all-reduce over a `torch.distributed` process group (gloo on
CPU, NCCL on GPU). A cache takes one and asks it before consuming anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch


class Agreement:
    """One rank: the local proposal is the decision."""

    def agree(self, proposals: Sequence[int]) -> list[int]:
        """Agree on several counts at once (one collective per call, whatever their number)."""
        return [int(p) for p in proposals]

    def agree_one(self, proposal: int) -> int:
        return self.agree([proposal])[0]


class GroupAgreement(Agreement):
    """All ranks of `group` take the element-wise minimum of their proposals (one all-reduce).

    Every rank must call `agree` the same number of times with the same number of counts:
    the cache calls it from the same operations on every rank, which the scheduler
    guarantees by running the same schedule everywhere.
    """

    def __init__(self, group: Optional[Any] = None) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("GroupAgreement needs an initialised torch.distributed process group")
        self.dist, self.group = dist, group
        self.calls = 0

    def agree(self, proposals: Sequence[int]) -> list[int]:
        if not proposals:
            return []
        values = torch.tensor([int(p) for p in proposals], dtype=torch.int64)
        self.dist.all_reduce(values, op=self.dist.ReduceOp.MIN, group=self.group)
        self.calls += 1
        return [int(v) for v in values.tolist()]


def finished_prefix(finished: Sequence[bool]) -> int:
    """How many acks at the head of a queue have finished: what a rank may propose to consume."""
    count = 0
    for done in finished:
        if not done:
            break
        count += 1
    return count
