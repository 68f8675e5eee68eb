"""The reference model: the plainest radix KV cache that satisfies the spec.

One module per tier over the state in `tree`; each imports only the modules above it here (and the spec), the
order `conformance.zoo.MODEL` compiles a mutant in.

| module | owns |
|---|---|
| `records` | the records (the slot pool, nodes, copies, prefetches, sessions, retraction backups) and small helpers |
| `tree` | the state and its radix tree: the walk, splits, lock paths, accounting and ranks every tier reads |
| `device` | the device tier (SPEC.md §4, §8): match, insert, locks and device eviction |
| `host` | the host tier (§9): backups under a write policy, host eviction, load-back, copies and acks, retraction |
| `sessions` | sessions and priority tiers (§11): refs along paths, demotion and restore, admission plans |
| `storage` | the storage tier (§10): store copies and prefetch |
| `cache` | `RefCache` over the tiers, and its targets `factory` and `alternative` (another correct choice per §6) |
"""

from kvcert.refimpl.cache import RefCache, alternative, factory
from kvcert.refimpl.records import SlotPool

__all__ = ["RefCache", "SlotPool", "alternative", "factory"]
