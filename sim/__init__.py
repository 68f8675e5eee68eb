"""`kvcert bench policy`: a discrete-event serving simulator that drives real caches (docs/bench_policy.md).

The seed's multi-turn stress test, reproduced: SGLang's priority-blind HiCache, kvcert.gpu's
proactive manager (SPEC.md §11), the RefAware fork, and two bounds, under one engine model.
"""
