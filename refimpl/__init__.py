"""The reference model: the plainest radix KV cache that satisfies the spec."""

from kvcert.refimpl.cache import RefCache, SlotPool, alternative, factory

__all__ = ["RefCache", "SlotPool", "alternative", "factory"]
