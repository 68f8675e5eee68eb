"""Key partitioning through SGLang 0.5.23's own scheduler (`conformance.adapters.sglang.partition`): with the salt as
the request's `cache_salt` every case passes; with it as the request's `extra_key`, exactly the cases whose salt spells
an adapter's id in SGLang's keys fail, across keys (SG-LORA, docs/findings.md)."""

from __future__ import annotations

from _sglang import require_sglang

require_sglang()

from kvcert.conformance.adapters.sglang import partition as sglang_partition  # noqa: E402
from kvcert.conformance.harness import partition  # noqa: E402

CASES = 40


def _run(probe: sglang_partition.SGLangProbe) -> partition.Report:
    try:
        return partition.run("sglang", probe, partition.cases(CASES, 0, probe.page, probe))
    finally:
        probe.close()


def test_cache_salts_and_adapters_stay_apart_and_reuse_where_they_agree() -> None:
    report = _run(sglang_partition.probe())
    assert report.passed and report.failures == [], report.failures[:3]
    assert report.reused > 5 and report.isolated > 5 and report.not_checked.get("images", 0) > 0


def test_an_extra_key_that_spells_an_adapters_id_shares_its_kv() -> None:
    report = _run(sglang_partition.probe_extra_key())
    failed = {f.case for f in report.failures}
    spelled = {c.name for c in partition.spelled(sglang_partition.probe_extra_key())}
    assert failed == spelled and len(spelled) == 2, failed
    assert all(any(w.startswith("ACROSS KEYS") for w in f.why) for f in report.failures)
