"""Two gloo ranks, rank-local copy failures, identical decisions (issue 4: multi-rank agreement).

Each rank runs the same schedule of copies and polls; one rank's copies fail now and then
(retried, so they finish later there). Each poll proposes the finished prefix of every ack
queue and consumes the agreed minimum: both ranks must consume exactly the same acks at
every poll, and never one that has not finished locally.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from kvcert.gpu.agreement import Agreement, GroupAgreement, finished_prefix

pytestmark = pytest.mark.skipif(not dist.is_gloo_available(), reason="torch built without gloo")

KINDS = ("write", "load", "store")


def _schedule(seed: int) -> list[tuple[str, int]]:
    """The shared schedule: issue a copy of a kind, complete the k-th issued, or poll."""
    rng = random.Random(seed)
    steps: list[tuple[str, int]] = []
    issued = 0
    for _ in range(300):
        roll = rng.random()
        if roll < 0.35 or issued == 0:
            steps.append(("issue", KINDS.index(rng.choice(KINDS))))
            issued += 1
        elif roll < 0.75:
            steps.append(("complete", rng.randrange(issued)))
        else:
            steps.append(("poll", 0))
    steps.append(("drain", issued))  # the engine goes idle: retry every copy until all ranks have consumed all
    return steps


def _rank(rank: int, world: int, store: str, out: str, seed: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    agreement = GroupAgreement()
    fail = random.Random(1000 + rank)  # rank-local faults: each rank its own
    queues: dict[int, list[list[int]]] = {k: [] for k in range(len(KINDS))}  # [copy id, finished]
    kind_of: list[int] = []
    log: list[list[int]] = []
    held_back = 0
    """Polls where this rank had more finished than the group agreed on: the agreement mattered."""
    for step, arg in _schedule(seed):
        if step == "issue":
            queues[arg].append([len(kind_of), 0])
            kind_of.append(arg)
        elif step == "complete":
            entry = next((e for e in queues[kind_of[arg]] if e[0] == arg), None)
            if entry is not None and not (rank == 1 and fail.random() < 0.3):  # a failed copy is retried later
                entry[1] = 1
        elif step == "drain":
            while True:  # collectives must match across ranks: loop until the group agrees nothing is left
                for k in range(len(KINDS)):
                    for e in queues[k]:
                        e[1] = e[1] or int(not (rank == 1 and fail.random() < 0.3))
                agreed = agreement.agree([finished_prefix([bool(e[1]) for e in queues[k]]) for k in range(len(KINDS))])
                consumed = []
                for k, n in enumerate(agreed):
                    consumed += [e[0] for e in queues[k][:n]]
                    del queues[k][:n]
                log.append(sorted(consumed))
                left = sum(len(q) for q in queues.values())
                if agreement.agree_one(-left) == 0:  # min of -left: the busiest rank decides
                    break
        else:
            local = [finished_prefix([bool(e[1]) for e in queues[k]]) for k in range(len(KINDS))]
            agreed = agreement.agree(local)
            assert all(a <= mine for a, mine in zip(agreed, local)), "consumed an ack this rank has not finished"
            held_back += agreed != local
            consumed = []
            for k, n in enumerate(agreed):
                consumed += [e[0] for e in queues[k][:n]]
                del queues[k][:n]
            log.append(sorted(consumed))
    Path(out).write_text(json.dumps({"log": log, "held_back": held_back, "issued": len(kind_of)}))
    dist.destroy_process_group()


@pytest.mark.parametrize("seed", [0, 1])
def test_two_gloo_ranks_consume_identical_acks(tmp_path: Path, seed: int) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    outs = [str(tmp_path / f"rank{r}.json") for r in range(2)]
    store = str(tmp_path / "store")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, 2, store, outs[r], seed)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0, f"rank exited with {p.exitcode}"
    results = [json.loads(Path(o).read_text()) for o in outs]
    logs = [r["log"] for r in results]
    assert logs[0] == logs[1], "the ranks consumed different acks"
    assert sum(len(c) for c in logs[0]) == results[0]["issued"], "after the drain every ack is consumed once"
    assert results[0]["held_back"] > 0, "rank 0 never waited for rank 1's retries: the failures did not bite"
    assert results[1]["held_back"] == 0, "the failing rank is always the slowest: it never waits"


def test_single_rank_agreement_is_the_local_count() -> None:
    assert Agreement().agree([3, 0, 2]) == [3, 0, 2]
    assert finished_prefix([True, True, False, True]) == 2 and finished_prefix([]) == 0


def _gpu_rank(rank: int, world: int, store: str, out: str) -> None:
    """One rank's kvcert.gpu cache; rank 1 alone has a failing copy and a corrupt stored page."""
    from kvcert.conformance.harness.storage import MemoryStorage
    from kvcert.gpu.cache import GpuCache
    from kvcert.spec import storage as l3
    from kvcert.spec.contracts import shape
    from kvcert.spec.types import CacheConfig

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    config = CacheConfig(capacity=16, host_capacity=16, prefetch_policy="wait_complete")
    cache = GpuCache(config, agreement=GroupAgreement())
    disk = MemoryStorage()
    pairs = l3.stored_pages(None, list(range(1, 9)), 1, config.kv_layers, l3.canonical_digest(1, config.model_id))
    disk.batch_set([k for k, _ in pairs], [v for _, v in pairs])
    if rank == 1:  # rank-local damage: token 7's page is corrupt on this rank's store only
        key = pairs[6][0]
        blob = bytearray(disk.contents()[key])
        blob[-1] ^= 1
        disk.batch_set([key], [bytes(blob)])
    cache.attach_storage(disk)
    log: dict[str, object] = {}
    slots = cache.alloc(3)
    cache.insert(None, (1, 2, 3), slots)
    (write,) = cache.snapshot().pending
    if rank == 1:
        cache.inject_fault("copy")  # this rank's copy engine fails the write once: it is retried
    cache.complete(write.id)
    log["poll while rank 1 retries"] = cache.poll()
    if rank == 1:
        cache.complete(write.id)
    log["poll after the retry"] = cache.poll()
    for c in cache.snapshot().pending:  # the write's ack issued store copies: land them everywhere
        cache.complete(c.id)
    log["store acks"] = cache.poll()
    match = cache.match_prefix(None, list(range(1, 9)))
    log["requested"] = cache.prefetch(match.node, None, list(range(1, 9)))
    (p,) = cache.snapshot().prefetches
    while True:
        view = next(v for v in cache.snapshot().prefetches if v.id == p.id)
        if view.failed or view.fetched == view.requested:
            break
        cache.fetch(p.id)
    log["fetched here"] = next(v for v in cache.snapshot().prefetches if v.id == p.id).fetched
    log["added"] = cache.check_prefetch(p.id)
    log["tree"] = sorted((str(k), str(v)) for k, v in shape(cache.snapshot()).items())
    Path(out).write_text(json.dumps(log))
    dist.destroy_process_group()


def test_two_gloo_ranks_of_the_gpu_cache_take_identical_decisions(tmp_path: Path) -> None:
    """The production cache over a gloo group: rank 1's copy fails once and one of its stored pages is
    corrupt; both ranks consume the same acks at every poll and insert the same prefetched pages."""
    outs = [str(tmp_path / f"gpu{r}.json") for r in range(2)]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_gpu_rank, args=(r, 2, str(tmp_path / "store"), outs[r])) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=180)
        assert p.exitcode == 0, f"rank exited with {p.exitcode}"
    logs = [json.loads(Path(o).read_text()) for o in outs]
    assert logs[0]["requested"] == 5, "pages 4..8 follow the cached [1, 2, 3]"
    assert logs[0]["fetched here"] == 5 and logs[1]["fetched here"] == 3, "the ranks' local progress differs"
    for key in ("poll while rank 1 retries", "poll after the retry", "store acks", "requested", "added", "tree"):
        assert logs[0][key] == logs[1][key], key
    assert logs[0]["poll while rank 1 retries"] == 0 and logs[0]["poll after the retry"] == 1
    assert logs[0]["added"] == 3, "the slowest rank decides: the page rank 1 could not verify is used nowhere"
