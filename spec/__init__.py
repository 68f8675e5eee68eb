"""The specification of a device-tier radix KV cache: types, pure functions, invariants, contracts.

Pure Python, no torch, so CrossHair can analyse it. SPEC.md beside this file is
the prose version; every invariant there has its checker here.

| module | owns |
|---|---|
| `types` | observable state, errors and capabilities shared by every layer |
| `ops` | the operation vocabulary as data: ops, traces and their JSON |
| `pages` | the pure page functions every radix cache needs, with contracts CrossHair verifies |
| `invariants` | state invariants: predicates over one `Snapshot` |
| `contracts` | operation contracts: relations over (snapshot before, arguments, result, snapshot after) |
| `decisions` | the choices SPEC.md §6 leaves open, as values: one frozen type per choice |
| `profiles` | the core relations and the engine profiles (§6) |
| `admission` | admission plans (§11.5, §11.6) as a pure function of a few counters and the request |
| `storage` | the storage tier (L3, §10): page keys, KV content and page records, as pure functions |
| `requests` | requests as an engine's scheduler sees them (§12): what a request-path target reports, and the model |
| `page_table` | the page-level core (§13): what a user of any prefix cache can observe, whatever holds its index |
| `block_table` | a block table's choices as vLLM 0.32 makes them (§13.2): the `vllm-0.32` profile's model of a block pool |
| `linker` | the linker tier (§14): a device pool linked straight to an external KV store, no host tier between |
| `decode` | decode-side admission (§15): a decode server's own cached prefix, the rest from a prefill peer |
| `offload` | the contract of an offload host tier (vLLM's `OffloadingManager`): host chunks filled and read back |
"""
