"""The production cache (torch KV pools, pinned host pool, copy engines).

Not built yet: it is the subject of issue 4. Nothing here claims otherwise.
"""
