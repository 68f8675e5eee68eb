"""Old target names, kept working: the modules an adapter or a reference engine had before the adapters were
sorted into rooms by engine (`adapters/sglang/`, `adapters/refaware/`, …) and the reference engines into
`reference/`.

A target is `module:factory`, and that string lives on in places kvcert does not rewrite: the findings' traces
(`"target"`), saved certificates, a user's CI scripts and corpus. Every place that turns a target or an adapter
module's name into an import goes through `canonical`, so an old name runs exactly the module it always named.
"""

from __future__ import annotations

__all__ = ["MODULES", "canonical", "canonical_module"]

_A = "kvcert.conformance.adapters."
_C = "kvcert.conformance."

MODULES: dict[str, str] = {
    **{
        _A + old: _A + new
        for old, new in {
            "_radix_tree": "kit.radix",
            "_sglang_kv": "kit.kv",
            "_sglang_env": "sglang.env",
            "_sglang_events": "sglang._events",
            "sglang_radix": "sglang.radix",
            "sglang_hicache": "sglang.hicache",
            "sglang_hicache_backend": "sglang.hicache_backend",
            "sglang_session": "sglang.session",
            "sglang_requests": "sglang.requests",
            "sglang_partition": "sglang.partition",
            "sglang_kvcert": "sglang.plugin",
            "sglang_decode": "sglang.decode",
            "sglang_linker": "sglang.linker",
            "sglang_fs_linker": "sglang.fs_linker",
            "sglang_hicache_storage": "sglang.storage.stepped",
            "sglang_file_store": "sglang.storage.file_store",
            "sglang_s3_store": "sglang.storage.s3_store",
            "_refaware_env": "refaware.env",
            "refaware_radix": "refaware.radix",
            "refaware_hicache": "refaware.hicache",
            "refaware_requests": "refaware.requests",
            "_vllm_env": "vllm.env",
            "vllm_block_pool": "vllm.block_pool",
            "vllm_kv": "vllm.kv",
            "vllm_offload": "vllm.offload",
            "vllm_requests": "vllm.requests",
            "_kvcr_env": "kvcr.env",
            "_kvcr_core": "kvcr._core",
            "kvcr_linker": "kvcr.linker",
        }.items()
    },
    **{_C + old: _C + "reference." + old for old in ("engine", "engine_linker", "engine_decode", "linker")},
}
"""Old module name -> the module it is now (one table: the rewrite and every replay read it)."""


def canonical_module(module: str) -> str:
    """The module `module` names now: itself unless it is an old name."""
    return MODULES.get(module, module)


def canonical(target: str) -> str:
    """`module:factory` with its module's current name; a string without `:` is taken as a module name."""
    module, sep, attr = target.partition(":")
    return canonical_module(module) + sep + attr
