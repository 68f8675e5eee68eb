"""`kvcert.gpu`'s structure: the tiers reach the tree through its public interface only, and gpu's modules import
one another in no circle (imports under `if TYPE_CHECKING` count: tools follow them)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from kvcert.gpu.sessions import RefTree
from kvcert.gpu.storage import StorageTree
from kvcert.gpu.tiers import TierTree
from kvcert.gpu.tree import RadixTree

GPU = Path(__file__).resolve().parent.parent / "gpu"
TIERS = ("host.py", "storage.py", "sessions.py", "cache.py")
"""The modules that work on a tree they hold (`tree`) or are (`cache.py`, the facade)."""
PRIVATE = re.compile(r"\btree\._\w+")


def private_uses(source: str) -> list[str]:
    """Every `tree._name` (or `self.tree._name`) in `source`, with its line number."""
    return [f"{i}: {m.group(0)}" for i, line in enumerate(source.splitlines(), 1) for m in PRIVATE.finditer(line)]


def gpu_imports(source: str) -> set[str]:
    """The `kvcert.gpu` modules `source` imports, at any depth (inside `if TYPE_CHECKING:` too)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        out.update(
            n.split(".")[2] for n in names if n.startswith("kvcert.gpu.") and (GPU / f"{n.split('.')[2]}.py").exists()
        )
    return out


def cycle(graph: dict[str, set[str]]) -> list[str]:
    """A circle of imports in `graph` (module -> modules it imports), as a path; [] when there is none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str]:
        state[m] = 1
        path.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return path[path.index(n) :] + [n]
            if n not in state and (found := visit(n)):
                return found
        path.pop()
        state[m] = 2
        return []

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return []


def test_the_tiers_call_no_private_method_of_the_tree() -> None:
    found = {name: private_uses((GPU / name).read_text()) for name in TIERS}
    assert found == {name: [] for name in TIERS}


def test_the_private_use_check_finds_one() -> None:
    assert private_uses("x = 1\n        tree._refresh(n)\n        self.tree._lock_path(n, +1)\n") == [
        "2: tree._refresh",
        "3: tree._lock_path",
    ]
    assert private_uses("tree.refresh(n); subtree._x; tree.root._y") == []


def test_gpu_modules_import_in_no_circle() -> None:
    graph = {p.stem: gpu_imports(p.read_text()) - {p.stem} for p in GPU.glob("*.py") if p.stem != "__init__"}
    assert graph["tree"] >= {"host", "storage", "sessions"}, "the check sees the tree's imports of its tiers"
    assert cycle(graph) == []
    for tier in ("host", "storage", "sessions", "tiers"):
        assert not graph[tier] & {"tree", "cache"}, f"{tier} imports {graph[tier] & {'tree', 'cache'}}"


def test_the_cycle_check_finds_one() -> None:
    src = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvcert.gpu.cache import GpuCache\n"
    assert gpu_imports(src) == {"cache"}
    assert cycle({"tree": {"host"}, "host": {"cache"}, "cache": {"tree"}}) == ["cache", "tree", "host", "cache"]
    assert cycle({"cache": {"tree", "host"}, "tree": {"host"}, "host": set()}) == []


def test_the_tiers_interface_is_public_and_documented() -> None:
    """Every member a tier's protocol names is a public member of the tree, and each method says why a tier needs it."""
    members = set()
    for proto in (TierTree, StorageTree, RefTree):
        members |= {m for m in vars(proto) if not m.startswith("_")} | set(getattr(proto, "__annotations__", {}))
    assert not {m for m in members if m.startswith("_")}
    methods = {m for m in members if callable(getattr(RadixTree, m, None))}
    assert methods == {
        "compact", "new_node", "forget", "selector", "set_device", "lock_path", "path_tokens", "issue_copy",
        "host_lock", "host_unlock_all", "split", "evict_device",
    }  # fmt: skip
    undocumented = sorted(m for m in methods if not (getattr(RadixTree, m).__doc__ or "").strip())
    assert undocumented == []
