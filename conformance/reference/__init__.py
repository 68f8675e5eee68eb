"""kvcert's reference engines: its own scheduler around a protocol cache, the request-path harness's positive
control, and the correct linker store the linker tier's rules are judged against.

| module | owns |
|---|---|
| `engine` | the reference engine (SPEC.md §12): its scheduler around kvcert's model or production cache |
| `engine_linker` | the reference engine with a direct linker, keeping the linker tier's rules (§14) |
| `engine_decode` | the reference decode server (§15): the decode side of a PD deployment |
| `linker` | the harness's external store behind a direct linker (§14): a correct linker in a faulty world |
"""
