"""Benchmarks, measured and never asserted: `meta` (`kvcert bench meta`: metadata calls/s of every
implementation on one trace, as ratios) and `sglang` (its SGLang drivers, imported when SGLang is)."""
