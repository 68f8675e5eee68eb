"""Adapters that put real engines' caches behind the Backend protocol."""
