"""kvcert's caches inside serving engines: each subpackage registers kvcert with one engine's own plugin seam.

| module | owns |
|---|---|
| `sglang/` | `--radix-cache-backend kvcert` for SGLang 0.5.23 (docs/sglang-plugin.md) |

These packages import `kvcert.gpu` and `kvcert.spec` and their engine, never the suite.
"""
