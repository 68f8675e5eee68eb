"""The reference model: the plainest radix KV cache that satisfies the spec."""

from kvcert.refimpl.cache import RefCache, alternative, factory
from kvcert.refimpl.records import SlotPool

__all__ = ["RefCache", "SlotPool", "alternative", "factory"]
