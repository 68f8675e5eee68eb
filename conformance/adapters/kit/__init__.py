"""The adapter kit: what an adapter author needs that is not the engine's own logic, public and typed
(docs/adapters.md, "Adapter kit"). kvcert's own adapters are written with it, and so is `examples/tinycache`.

| module | owns |
|---|---|
| `tree` | any radix tree: node handles by the engine's node ids (`NodeHandles`), the tree walked parents first (`walk_tree`), an allocator's None as `PoolExhausted` (`take_slots`); plain Python |
| `radix` | an SGLang-style `RadixCache` (SGLang, its forks): the logical clock its nodes are stamped with, handles, lock calls, slots from a torch allocator, a snapshot of its tree, and the capabilities such an adapter declares (`radix_capabilities`) |
| `kv` | the spec's KV bytes in an MHA pool's per-layer K and V buffers and back, bit for bit (`write_pool`, `read_pool`), and a paged allocator's free slots |
| `cpu` | an SGLang-family engine imported on a CPU-only machine (`install_shims`, `quiet_imports`), and `OrderedSet`, which makes its sets of nodes leave in one order in every run |

The names below are importable from the kit itself; the rest from their module (`kit.kv`, `kit.radix`, `kit.cpu`),
which import torch or touch `sys.meta_path` only when imported.
"""

from kvcert.conformance.adapters.kit.tree import NodeHandles, take_slots, walk_tree

__all__ = ["NodeHandles", "take_slots", "walk_tree"]
