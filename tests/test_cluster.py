"""Where cells run (`conformance.certification.cluster`) and the shared failure corpus.

A Ray run on a local cluster gives the certificate a one-process run gives, digest for digest; a failure found
on a Ray worker comes back to the caller's disk and into the corpus; the next run replays the corpus first and
fails on it without walking. With `KVCERT_RAY=1` (what `scripts/test.sh` and CI set) Ray is required: a
missing one fails instead of skipping.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvcert.conformance.certification.certify import CorpusError, certify, load_corpus
from kvcert.conformance.certification.cluster import RayUnavailable, map_ordered
from kvcert.conformance.cli import app
from kvcert.spec.ops import Trace

TWO_CELLS = dict(page_sizes=[4], policies=["lru"], write_policies=["write_through"], prefetch_policies=[])
MUTANT = "kvcert.conformance.zoo:lock_skips_self"  # a zoo mutant, loadable by name (each worker imports it)
MUTANT_CELL = dict(page_sizes=[1], policies=["lru"], write_policies=[], prefetch_policies=[])


def _ray() -> object:
    try:
        import ray
    except ImportError:
        if os.environ.get("KVCERT_RAY", "0") == "1":
            pytest.fail("KVCERT_RAY=1 but Ray does not import (scripts/bootstrap.sh installs requirements/ray.txt)")
        pytest.skip("Ray not installed (KVCERT_RAY=1 scripts/bootstrap.sh)")
    return ray


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """One local Ray cluster for the module: `map_ordered` uses a running one and leaves it running."""
    ray = _ray()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)  # type: ignore[attr-defined]
    yield "local"
    ray.shutdown()  # type: ignore[attr-defined]


def _digests(cert: object) -> list[tuple[str, int, str]]:
    return [(c.write_policy, c.steps, c.digest) for c in cert.cells]  # type: ignore[attr-defined]


def test_a_ray_run_is_the_one_process_run(cluster: str, tmp_path: Path) -> None:
    run = dict(examples=6, steps=30, seed=5, out_dir=tmp_path, driver="random", **TWO_CELLS)
    here = certify("kvcert.gpu:factory", **run)  # type: ignore[arg-type]
    there = certify("kvcert.gpu:factory", ray=cluster, **run)  # type: ignore[arg-type]
    assert here.passed and there.passed and len(here.cells) == 2
    assert _digests(here) == _digests(there) and all(steps > 0 for _, steps, _ in _digests(here))


def test_a_failure_on_a_worker_reaches_the_corpus_and_the_next_run_replays_it_first(
    cluster: str, tmp_path: Path
) -> None:
    corpus, out = tmp_path / "corpus", tmp_path / "out"
    run = dict(examples=200, steps=50, seed=0, driver="random", corpus=corpus, **MUTANT_CELL)
    found = certify(MUTANT, ray=cluster, out_dir=out, **run)  # type: ignore[arg-type]
    (cell,) = found.cells
    assert not cell.passed and cell.reproduced and cell.corpus_replayed == 0 and cell.steps > 0
    saved = Path(cell.trace_path or "")
    assert saved.parent == out.resolve() and saved.exists()
    assert [p.name for p in corpus.iterdir()] == [saved.name]
    assert (corpus / saved.name).read_text() == saved.read_text()
    assert "trace_json" not in json.loads(found.to_json())["cells"][0]

    # the next run, here this time: the corpus trace fails before any walk, with the rule the walk found
    again = certify(MUTANT, out_dir=tmp_path / "again", **run)  # type: ignore[arg-type]
    (cell2,) = again.cells
    assert not cell2.passed and cell2.reproduced and cell2.corpus_replayed == 1 and cell2.steps == 0
    assert "-corpus-" in (cell2.trace_path or "")
    assert {f["invariant"] for f in cell2.failures} == {f["invariant"] for f in cell.failures}
    assert Trace.from_json(Path(cell2.trace_path or "").read_text()).ops == Trace.from_json(saved.read_text()).ops
    assert len(list(corpus.iterdir())) == 1  # a corpus failure is not added to the corpus again


def test_a_corpus_trace_that_passes_changes_nothing(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    found = certify(
        MUTANT, examples=200, steps=50, seed=0, out_dir=tmp_path, driver="random", corpus=corpus, **MUTANT_CELL
    )  # type: ignore[arg-type]
    assert not found.passed and len(list(corpus.iterdir())) == 1
    run = dict(examples=8, steps=30, seed=1, out_dir=tmp_path / "clean", driver="random", **MUTANT_CELL)
    plain = certify("kvcert.refimpl:factory", **run)  # type: ignore[arg-type]
    with_corpus = certify("kvcert.refimpl:factory", corpus=corpus, **run)  # type: ignore[arg-type]
    assert plain.passed and with_corpus.passed
    assert with_corpus.cells[0].corpus_replayed == 1 and plain.cells[0].corpus_replayed == 0
    assert _digests(plain) == _digests(with_corpus)
    # a corpus trace of another config is not this cell's
    other = certify("kvcert.refimpl:factory", corpus=corpus, **{**run, "page_sizes": [4]})  # type: ignore[arg-type]
    assert other.passed and other.cells[0].corpus_replayed == 0


def test_a_bad_corpus_file_stops_the_run_before_it_starts(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.json").write_text('{"not": "a trace"}')
    with pytest.raises(CorpusError, match="a.json"):
        load_corpus(corpus)
    out = tmp_path / "out"
    result = CliRunner().invoke(
        app, ["fuzz", "kvcert.refimpl:factory", "--examples", "1", "--corpus", str(corpus), "--out", str(out)]
    )
    assert result.exit_code == 2 and "a.json" in result.output and not out.exists()
    assert load_corpus(tmp_path / "absent") == ()


def test_no_ray_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    with pytest.raises(RayUnavailable, match="requirements/ray.txt"):
        certify("kvcert.refimpl:factory", examples=1, out_dir=tmp_path, ray="local", driver="random", **TWO_CELLS)  # type: ignore[arg-type]
    result = CliRunner().invoke(app, ["fuzz", "kvcert.refimpl:factory", "--examples", "1", "--ray", "local"])
    assert result.exit_code == 2 and "requirements/ray.txt" in result.output


def test_map_ordered_keeps_call_order_whatever_the_placement() -> None:
    calls = [((x,), {}) for x in (3, 1, 2)]
    assert list(map_ordered(abs, calls)) == [3, 1, 2]
    assert list(map_ordered(abs, calls, jobs=2)) == [3, 1, 2]
