"""Key partitioning (`kvcert partition`): the rules on a small keyed cache written here (a correct one passes; one
that drops a key, one that never reuses, one that hands out the wrong pages each fail under the rule they break),
then vLLM 0.32's `KVCacheManager` in its own environment (`.venv-vllm`), and vLLM broken on purpose."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import pytest
from _vllm import run_vllm

from kvcert.conformance.harness import partition
from kvcert.conformance.harness.partition import Case, Image, Keys, Served


class _Keyed:
    """A prefix cache of `page`-token pages keyed by the chain of (tokens, LoRA, salt, the images before the page's
    end); `drop` forgets one key, `cold` never reuses, `stray` reports fresh pages for a hit."""

    page = 4

    def __init__(self, drop: Optional[str] = None, cold: bool = False, stray: bool = False) -> None:
        self.drop, self.cold, self.stray = drop, cold, stray
        self.fresh()

    def fresh(self) -> None:
        self.table: dict[Any, int] = {}
        self.next = 0

    def serve(self, tokens: Sequence[int], keys: Keys) -> Served:
        p, chain, parent = self.page, [], None
        for i in range(len(tokens) // p):
            end = (i + 1) * p
            parent = (
                parent,
                tuple(tokens[i * p : end]),
                None if self.drop == "lora" else keys.lora,
                None if self.drop == "salt" else keys.salt,
                () if self.drop == "images" else tuple(im for im in keys.images if im.offset < end),
            )
            chain.append(parent)
        pages: list[int] = []
        for key in chain[: (len(tokens) - 1) // p]:
            if self.cold or key not in self.table:
                break
            pages.append(self.table[key])
        hit = len(pages)
        if self.stray:
            pages = []
        while len(pages) < -(-len(tokens) // p):
            pages.append(self.next)
            self.next += 1
        for key, page in zip(chain, pages):
            self.table.setdefault(key, page)
        return Served(hit * p, tuple(pages))


def _run(probe: _Keyed, count: int = 300) -> partition.Report:
    return partition.run("keyed", probe, partition.cases(count, 0, probe.page))


def test_a_correct_keyed_cache_passes_with_both_halves_exercised() -> None:
    report = _run(_Keyed())
    assert report.passed and report.failures == []
    assert report.reused > 50 and report.isolated > 50, (report.reused, report.isolated)


@pytest.mark.parametrize(
    ("broken", "case", "rule"),
    [
        (_Keyed(drop="salt"), "another cache salt", "ACROSS KEYS"),
        (_Keyed(drop="lora"), "another LoRA path", "ACROSS KEYS"),
        (_Keyed(drop="images"), "another image (the page before it is shared)", "ACROSS KEYS"),
        (_Keyed(cold=True), "the same prompt (positive control)", "POSITIVE CONTROL"),
        (_Keyed(stray=True), "the same LoRA", "not the first request's"),
    ],
)
def test_a_broken_cache_fails_under_the_rule_it_breaks(broken: _Keyed, case: str, rule: str) -> None:
    report = _run(broken)
    assert not report.passed
    why = {f.case: " ".join(f.why) for f in report.failures}
    assert rule in why.get(case, ""), why.get(case)


def test_pages_before_an_image_may_be_shared_and_none_after() -> None:
    p = tuple(range(20))
    one, two = Keys(images=(Image("x", 8, 4),)), Keys(images=(Image("y", 8, 4),))
    assert partition.agreed_pages(Case("c", p, one, p, two), 4) == 2
    assert partition.agreed_pages(Case("c", p, one, p, one), 4) == 4  # the last token is always computed
    assert partition.agreed_pages(Case("c", p, Keys(salt="s"), p, Keys()), 4) == 0
    assert partition.agreed_pages(Case("c", p, Keys(), p[:10] + (99,) * 10, Keys()), 4) == 2


def test_the_same_seed_gives_the_same_cases() -> None:
    assert partition.cases(50, 3, 16) == partition.cases(50, 3, 16) != partition.cases(50, 4, 16)


def test_a_target_that_cannot_load_here_is_refused_with_where_to_run_it() -> None:
    from typer.testing import CliRunner

    from kvcert.conformance.cli import app

    for target in ("kvcert.conformance.adapters.nonexistent:probe", "no-colon"):
        res = CliRunner().invoke(app, ["partition", target])
        assert res.exit_code == 2 and ".venv-vllm" in res.output, res.output


# --------------------------------------------------------------------------- vLLM 0.32, in .venv-vllm


def _vllm(args: list[str], code: Optional[str] = None) -> tuple[int, str, str]:
    """(exit status, stdout and stderr, stdout)."""
    return run_vllm(["python", "-c", code, *args] if code else ["kvcert", "partition", *args])


def test_vllm_keeps_keys_apart_and_reuses_where_they_agree(tmp_path: Path) -> None:
    rc, out, _ = _vllm(
        ["kvcert.conformance.adapters.vllm.kv:probe", "--cases", "300", "--json", str(tmp_path / "r.json")]
    )
    report = json.loads((tmp_path / "r.json").read_text())
    assert rc == 0 and report["passed"] and report["failures"] == [], out[-2000:]
    assert report["cases"] == 300 + len(partition.DIRECTED(16)) and report["reused"] > 50 and report["isolated"] > 50
    assert report["not_checked"] == {}


def test_vllms_scheduler_keeps_keys_apart_and_says_what_it_did_not_check(tmp_path: Path) -> None:
    """Through vLLM's own `Scheduler` (a stand-in model config that takes no images): the LoRA and salt cases pass,
    and the image cases are counted NOT CHECKED rather than passed."""
    target = "kvcert.conformance.adapters.vllm.kv:probe_scheduler"
    rc, out, _ = _vllm([target, "--cases", "300", "--json", str(tmp_path / "r.json")])
    report = json.loads((tmp_path / "r.json").read_text())
    assert rc == 0 and report["passed"] and report["failures"] == [], out[-2000:]
    assert report["reused"] > 20 and report["isolated"] > 20 and report["not_checked"]["images"] > 0
    assert "NOT CHECKED: images" in out


PLANT = """
import json, sys
import vllm.v1.core.kv_cache_utils as utils
from kvcert.conformance.harness import partition
from kvcert.conformance.adapters.vllm import kv as vllm_kv
kind = sys.argv[1]
if kind == "keyless":  # blocks hashed without their extra keys (LoRA, salt, images)
    utils.generate_block_hash_extra_keys = lambda request, start, end, mm_idx: (None, mm_idx)
elif kind == "salt-as-lora":  # the salt and the LoRA's name hashed into one slot
    real = utils.generate_block_hash_extra_keys
    def merged(request, start, end, mm_idx):
        keys, nxt = real(request, start, end, mm_idx)
        name = request.lora_request.lora_name if request.lora_request else request.cache_salt
        rest = tuple(k for k in (keys or ()) if k[0] not in ("lora", "cache_salt"))
        return (("key", name),) + rest if name else (rest or None), nxt
    utils.generate_block_hash_extra_keys = merged
probe = getattr(vllm_kv, sys.argv[2])()
r = partition.run("planted", probe, partition.cases(100, 0, probe.page))
print(json.dumps([f.case for f in r.failures]))
"""


@pytest.mark.parametrize(
    ("plant", "probe", "case"),
    [
        ("keyless", "probe", "another cache salt"),
        ("salt-as-lora", "probe", "a salt that spells a LoRA's name"),
        ("keyless", "probe_scheduler", "another LoRA path"),
    ],
)
def test_the_cases_catch_a_vllm_that_mixes_its_keys(plant: str, probe: str, case: str) -> None:
    rc, out, stdout = _vllm([plant, probe], code=PLANT)
    assert rc == 0, out[-2000:]
    failed = json.loads(stdout.strip().splitlines()[-1])
    assert case in failed, failed


class _Joined(_Keyed):
    """Keys a page by one string, the salt followed by the adapter's engine id (as SGLang joins extra_key and
    lora_id); `tagged` keeps the two apart instead."""

    def __init__(self, tagged: bool = False) -> None:
        super().__init__()
        self.tagged = tagged

    def spellings(self, lora: tuple[str, str]) -> tuple[str, ...]:
        return (f"id-{lora[0]}@{lora[1]}",)

    def serve(self, tokens: Sequence[int], keys: Keys) -> Served:
        joined = (keys.salt or "") + (self.spellings(keys.lora)[0] if keys.lora else "")
        key = (keys.salt, keys.lora) if self.tagged else joined
        return super().serve(tokens, Keys(salt=key or None, images=keys.images))  # type: ignore[arg-type]


def test_an_engine_that_joins_its_keys_into_one_string_fails_the_spelled_cases() -> None:
    """The directed cases a probe's own key names make (`spelled`): a salt equal to the adapter's engine id."""
    joined = _Joined()
    report = partition.run("joined", joined, partition.cases(100, 0, joined.page, joined))
    spelled = {c.name for c in partition.spelled(joined)}
    assert len(spelled) == 2 and {f.case for f in report.failures} == spelled
    tagged = _Joined(tagged=True)
    assert partition.run("tagged", tagged, partition.cases(100, 0, tagged.page, tagged)).passed
    assert partition.spelled(_Keyed()) == []
