"""`sglang-fs-linker` 0.1.0 behind SGLang 0.5.23's linker wrapper (conformance/adapters/sglang/fs_linker.py).

SGLang's own factory refuses the package as shipped (it targets an older linker contract). Bridged, a directed
conversation drives its whole cycle through SGLang's scheduler (pages offloaded to files, evicted from the device,
found by a lookup and loaded back) and must pass; under each fault a filesystem store meets it keeps running or fails
as the certification found (docs/linkers.md): a truncated page file or one deleted under a started batch raises out
of SGLang's scheduler (INV-RP-1), a flipped byte is served as KV (INV-KV-1, INV-REQ-2). Bugs planted into the
package's linker fail the same conversation under the rule they break. Skipped without the `sglang` extra or
without the package (both required with KVCERT_SGLANG=1).
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional
from unittest import mock

import pytest
from _sglang import require_sglang, required

require_sglang()
if importlib.util.find_spec("sglang_fs_linker") is None:
    if required():
        pytest.fail("KVCERT_SGLANG=1 but sglang_fs_linker is not installed (requirements/sglang.txt)", pytrace=False)
    pytest.skip("sglang_fs_linker not installed: run scripts/install_sglang.sh", allow_module_level=True)

from _linker import CONFIG, conversation  # noqa: E402
from sglang.srt.mem_cache.unified_cache.linker_factory import create_unified_cache_linker  # noqa: E402
from sglang_fs_linker.linker import FileSystemLinker  # noqa: E402

from kvcert.conformance.adapters.sglang import fs_linker as sglang_fs_linker  # noqa: E402
from kvcert.conformance.certification.certify import certify  # noqa: E402
from kvcert.conformance.harness.driver import ConformanceFailure  # noqa: E402
from kvcert.conformance.harness.requests import RequestHarness  # noqa: E402

pytestmark = pytest.mark.sglang


def test_sglang_refuses_the_package_as_shipped() -> None:
    """What a user who launches with --unified-cache-external-linker-backend dynamic and
    --unified-cache-external-linker-config '{"linker": "FileSystemLinker", "linker_module_path":
    "sglang_fs_linker.linker", ...}' sees: SGLang's factory refuses the class before it builds it."""
    config = {
        "linker": "FileSystemLinker",
        "linker_module_path": "sglang_fs_linker.linker",
        "linker_extra_config": {"directory": "/nonexistent", "namespace": "x"},
    }
    with pytest.raises(ValueError) as refused:
        create_unified_cache_linker(None, None, backend="dynamic", config=config, components=set())  # type: ignore[arg-type]
    assert str(refused.value) == (
        "sglang_fs_linker.linker.FileSystemLinker must implement all UnifiedCacheLinker methods: "
        "['finish_layer_wise_loading']"
    )
    assert FileSystemLinker.__abstractmethods__ == frozenset({"finish_layer_wise_loading"})
    # The rest of the older contract, which the abstract check does not see: it would fail at the constructor
    # (forward_stream=) and at the first offload (session_id=).
    assert "forward_stream" not in inspect.signature(FileSystemLinker.__init__).parameters
    assert "session_id" not in inspect.signature(FileSystemLinker.offload).parameters
    assert hasattr(FileSystemLinker, "pop_completed_load") and hasattr(FileSystemLinker, "num_completed_loads")
    assert not inspect.isabstract(sglang_fs_linker.BridgedFileSystemLinker)


def _conversation(fault: Optional[str] = None) -> tuple[Any, RequestHarness]:
    return conversation(sglang_fs_linker.factory, fault)


def test_a_hit_loads_back_from_the_files_and_close_deletes_them() -> None:
    backend, h = _conversation()
    reached = backend.reached()
    assert reached["lookup hit"] >= 1 and reached["load batch landed"] >= 1 and reached["offload stored"] >= 10
    directory = backend.directory
    assert any(directory.glob("*.pt"))
    h.close()
    assert not directory.exists() and not directory.parent.exists()


@pytest.mark.parametrize(
    "fault, what",
    [("drop", "lookup miss"), ("load_refuse", "load refused"), ("offload_fail", "offload failed")],
)
def test_the_faults_it_survives(fault: str, what: str) -> None:
    """A page lost before a lookup is a miss, one lost between the lookup and the load is a refused load (SGLang
    recomputes), a full disk fails the offload (the node is not marked stored)."""
    backend, h = _conversation(fault)
    assert backend.reached()[what] >= 1, backend.reached()
    h.close()


@pytest.mark.parametrize(
    "fault, rules, message",
    [
        ("truncate", {"INV-RP-1"}, "RuntimeError: PytorchStreamReader failed reading zip archive"),
        ("load_fail", {"INV-RP-1"}, "FileNotFoundError"),
        ("corrupt", {"INV-KV-1", "INV-REQ-2"}, "holds other KV"),
    ],
)
def test_a_damaged_or_vanished_page_under_a_load_is_a_finding(fault: str, rules: set[str], message: str) -> None:
    """The findings of docs/linkers.md, reproduced: the package reads a page file inside start_layer_wise_loading
    with torch.load and no checksum, so an unreadable file raises out of SGLang's scheduler (the serving process
    exits) and a flipped byte is served as the request's KV."""
    with pytest.raises(ConformanceFailure) as caught:
        _conversation(fault)
    found = caught.value.violations
    assert found and {v.inv for v in found} <= rules, found
    assert any(message in v.message for v in found), found


@contextmanager
def _planted(name: str) -> Iterator[None]:
    if name == "lookup-one-more":  # the lookup reports one page more than it has files for
        real_lookup = FileSystemLinker.lookup

        def lookup(self: Any, rid: str, transfers: Any) -> list[int]:
            hits = real_lookup(self, rid, transfers)
            return hits + [len(hits) + 1] if len(hits) < len(transfers[0].keys) else hits

        with mock.patch.object(FileSystemLinker, "lookup", lookup):
            yield
    elif name == "offload-true-on-failure":  # a failed write is published as a success
        real_offload = FileSystemLinker.offload

        def offload(self: Any, transfers: Any) -> bool:
            queued = real_offload(self, transfers)
            if self.completed_offloads and not self.completed_offloads[-1]:
                self.completed_offloads[-1] = True
            return bool(queued)

        with mock.patch.object(FileSystemLinker, "offload", offload):
            yield
    else:
        raise ValueError(name)


@pytest.mark.parametrize(
    "plant, fault, rule",
    [("lookup-one-more", None, "INV-LINK-1"), ("offload-true-on-failure", "offload_fail", "INV-LINK-6")],
)
def test_each_planted_linker_bug_is_caught(plant: str, fault: Optional[str], rule: str) -> None:
    with _planted(plant), pytest.raises(ConformanceFailure) as caught:
        _conversation(fault)
    assert rule in {v.inv for v in caught.value.violations}, caught.value.violations


def test_a_short_certification_of_the_faults_it_survives_passes() -> None:
    with tempfile.TemporaryDirectory() as out:
        cert = certify(
            "kvcert.conformance.adapters.sglang.fs_linker:factory_survivable",
            examples=8,
            page_sizes=(4,),
            out_dir=Path(out),
        )
    assert cert.passed, [f for c in cert.cells for f in c.failures]
    assert sum(c.ops["LinkerFault"] for c in cert.cells) > 0


def test_no_page_directory_is_left_behind() -> None:
    backend = sglang_fs_linker.factory(CONFIG)
    root = backend.directory.parent
    assert root.is_dir() and os.path.basename(root).startswith("kvcert-fs-linker-")
    backend.close()
    backend.close()  # twice is harmless
    assert not root.exists()
