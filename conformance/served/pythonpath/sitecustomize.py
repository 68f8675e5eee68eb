"""Imported by Python at start-up in every process of a served SGLang target (kvcert puts this folder first on
PYTHONPATH), so the engine's own entry point and the processes it spawns run on a CPU-only machine.

It acts only where `KVCERT_SERVED_STANDINS` names it, so any other Python started under the same environment is
left alone, and each stand-in is a deviation the certificate declares (NOT CHECKED):

- `sglang`: triton and torchvision stubs (kvcert's in-process shims, `_sglang_env.install_shims`), and a
  stand-in for the CUDA-only kernel package `sgl_kernel` whose every function raises if called: a served run
  that reached a kernel would fail loudly, never compute something else.
- `hicache-host`: SGLang's HiCache registers its host pool with CUDA (`cudaHostRegister`), which has no CPU
  meaning; the stand-in makes that registration a no-op, in the server process, and changes nothing else.

`KVCERT_SERVED_PLANT` (tests only) plants one of `kvcert.conformance.served.plants` in kvcert's SGLang backend.
"""

from __future__ import annotations

import os

_WANT = set(filter(None, os.environ.get("KVCERT_SERVED_STANDINS", "").split(",")))

if _WANT:
    from kvcert.conformance.served import standins

    standins.install(_WANT)

if os.environ.get("KVCERT_SERVED_PLANT"):
    from kvcert.conformance.served import plants

    plants.install(os.environ["KVCERT_SERVED_PLANT"])
