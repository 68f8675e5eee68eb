"""Pure functions every radix cache needs, with contracts CrossHair verifies.

The contracts are PEP 316 docstrings (`pre:` / `post:`); `crosshair check
spec/pages.py` searches for inputs that break them (CI runs it on a fixed
budget). Keep these functions tiny and total: they are the vocabulary the
rest of the spec is written in.
"""

from __future__ import annotations

from collections.abc import Sequence

# Policy-metadata positions inside a rank tuple are spelled out in SPEC.md §4.5.
RANKED_POLICIES = ("lru", "lfu", "fifo", "mru", "priority", "slru", "tlru")


def page_floor(n: int, page_size: int) -> int:
    """The largest multiple of `page_size` that is not above `n`.

    pre: n >= 0
    pre: page_size >= 1
    post: __return__ % page_size == 0
    post: 0 <= n - __return__ < page_size
    """
    return n - n % page_size


def page_ceil(n: int, page_size: int) -> int:
    """The smallest multiple of `page_size` that is not below `n` (a partial page takes a whole one).

    pre: n >= 0
    pre: page_size >= 1
    post: __return__ % page_size == 0
    post: 0 <= __return__ - n < page_size
    """
    return n + (-n) % page_size


def is_aligned(n: int, page_size: int) -> bool:
    """True when a length of `n` tokens is whole pages.

    pre: page_size >= 1
    post: __return__ == (n >= 0 and n % page_size == 0)
    """
    return n >= 0 and n % page_size == 0


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences.

    post: 0 <= __return__ <= min(len(a), len(b))
    post: list(a[:__return__]) == list(b[:__return__])
    post: __return__ == min(len(a), len(b)) or a[__return__] != b[__return__]
    """
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def match_len(a: Sequence[int], b: Sequence[int], page_size: int) -> int:
    """Common prefix of `a` and `b` in whole pages: what a radix edge can share.

    pre: page_size >= 1
    post: 0 <= __return__ <= min(len(a), len(b))
    post: __return__ % page_size == 0
    post: list(a[:__return__]) == list(b[:__return__])
    post: __return__ + page_size > common_prefix_len(a, b)
    """
    return page_floor(common_prefix_len(a, b), page_size)


def split_key(key: tuple[int, ...], at: int, page_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Split an edge key at a page boundary into (prefix, suffix).

    pre: page_size >= 1
    pre: len(key) % page_size == 0
    pre: 0 < at < len(key)
    pre: at % page_size == 0
    post: __return__[0] + __return__[1] == key
    post: len(__return__[0]) == at
    post: len(__return__[0]) % page_size == 0 and len(__return__[1]) % page_size == 0
    post: len(__return__[0]) > 0 and len(__return__[1]) > 0
    """
    return key[:at], key[at:]


def first_page(key: Sequence[int], page_size: int) -> tuple[int, ...]:
    """The child-selector of an edge: its first page of tokens.

    pre: page_size >= 1
    pre: len(key) >= page_size
    post: len(__return__) == page_size
    post: list(__return__) == list(key[:page_size])
    """
    return tuple(key[:page_size])


def policy_rank(
    policy: str,
    last_access: int,
    hit_count: int,
    creation: int,
    priority: int,
    *,
    protected_threshold: int = 2,
    depth: int = 0,
    size: int = 0,
    history: int = 0,
    threshold: int = 0,
    next_prompt_estimate: int = 0,
) -> tuple[int, ...]:
    """Eviction rank of a leaf under `policy`: the smallest rank goes first.

    Mirrors SGLang's `evict_policy.py` with a logical clock in place of
    `time.monotonic()`. The keyword arguments matter to one policy each (SPEC.md §4.5):
    `protected_threshold` to slru (its `SLRUStrategy` parameter); to tlru the node's
    structure, `depth` (tokens from the root to the node's end) and `size` (its own
    tokens), its branch's `history` (the high-water depth, §4.7), and its parameters
    `threshold` and `next_prompt_estimate` (`TLRUStrategy`'s, in tokens).

    The postconditions say what each policy means without restating the
    tuples: which metadata a rank may read, and which way each one pushes.

    pre: policy in RANKED_POLICIES
    pre: policy != "tlru" or 0 <= size <= depth
    post: len(__return__) >= 1
    post: __return__ == policy_rank(policy, 0 if policy == "fifo" else last_access, hit_count if policy in ("lfu", "slru") else 0, creation if policy == "fifo" else 0, priority if policy == "priority" else 0, protected_threshold=protected_threshold if policy == "slru" else 2, depth=depth if policy == "tlru" else 0, size=size if policy == "tlru" else 0, history=history if policy == "tlru" else 0, threshold=threshold if policy == "tlru" else 0, next_prompt_estimate=next_prompt_estimate if policy == "tlru" else 0)
    post: policy not in ("lru", "lfu", "priority") or __return__ < policy_rank(policy, last_access + 1, hit_count, creation, priority)
    post: policy != "mru" or __return__ > policy_rank(policy, last_access + 1, hit_count, creation, priority)
    post: policy != "fifo" or __return__ < policy_rank(policy, last_access, hit_count, creation + 1, priority)
    post: policy != "lfu" or __return__ < policy_rank(policy, last_access - 1, hit_count + 1, creation, priority)
    post: policy != "priority" or __return__ < policy_rank(policy, last_access - 1, hit_count, creation, priority + 1)
    post: policy != "slru" or __return__ < policy_rank(policy, last_access + 1, hit_count, creation, priority, protected_threshold=protected_threshold)
    post: policy != "slru" or __return__ <= policy_rank(policy, last_access, hit_count + 1, creation, priority, protected_threshold=protected_threshold)
    post: policy != "slru" or hit_count < protected_threshold or __return__ > policy_rank(policy, last_access + 1, protected_threshold - 1, creation, priority, protected_threshold=protected_threshold)
    post: policy != "tlru" or __return__[1:] == (last_access,)
    post: policy != "tlru" or (__return__[0] < 0) == (depth - size >= history + next_prompt_estimate - threshold)
    post: policy != "tlru" or __return__ <= policy_rank(policy, last_access, hit_count, creation, priority, depth=depth, size=size, history=history + 1, threshold=threshold, next_prompt_estimate=next_prompt_estimate)
    """
    if policy == "lru":
        return (last_access,)
    if policy == "lfu":
        return (hit_count, last_access)
    if policy == "fifo":
        return (creation,)
    if policy == "mru":
        return (-last_access,)
    if policy == "priority":
        return (priority, last_access)
    if policy == "slru":
        # Two segments: probationary (fewer hits than the threshold) before protected, each in recency order.
        return (1 if hit_count >= protected_threshold else 0, last_access)
    # T-LRU: a node whose ancestors already hold the branch's budget (history + next_prompt_estimate -
    # threshold tokens) is "TEL-safe" and goes before every other node; within each class, recency.
    budget = max(history + next_prompt_estimate - threshold, 0)
    return (-1 if depth - size >= budget else 0, last_access)


def min_rank_ids(candidates: Sequence[tuple[tuple[int, ...], int]]) -> list[int]:
    """Ids of the candidates whose rank is smallest: the legal next victims.

    post: (len(__return__) == 0) == (len(candidates) == 0)
    post: all(any(c[1] == i and all(c[0] <= d[0] for d in candidates) for c in candidates) for i in __return__)
    post: all(c[1] in __return__ for c in candidates if all(c[0] <= d[0] for d in candidates))
    """
    if not candidates:
        return []
    best = min(rank for rank, _ in candidates)
    # `rank <= best` is `rank == best` here (best is the minimum). It is spelled `<=`
    # because CrossHair (0.0.113) compares two symbolic tuples with `==` as whole SMT
    # arrays, past their lengths, and so reports equal ranks as unequal.
    return [node_id for rank, node_id in candidates if rank <= best]


def overshoot_ok(freed: int, asked: int, last_node_size: int) -> bool:
    """Eviction may pass `asked` only by the node that crossed it.

    True when stopping before the last evicted node would have freed too little.

    pre: freed >= 0 and last_node_size >= 0 and last_node_size <= freed
    post: __return__ == (freed - last_node_size < asked or freed == 0)
    """
    return freed == 0 or freed - last_node_size < asked
