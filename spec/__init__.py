"""The specification of a device-tier radix KV cache: types, pure functions, invariants, contracts.

Pure Python, no torch, so CrossHair can analyse it. SPEC.md beside this file is
the prose version; every invariant there has its checker here.
"""
