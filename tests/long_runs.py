"""The long runs: tests CI leaves out to stay under 15 minutes, and what CI keeps of each (docs/ci.md).

`tests/conftest.py` marks every test whose node id starts with a key here `long`. `scripts/test.sh` (CI, the README's
test command) deselects them; `scripts/long.sh` runs only them; `KVCERT_LONG=1 scripts/test.sh` runs everything. A
key that matches no collected test stops the collection, so the table cannot go stale silently.

Each entry is (why it is long, what CI still runs of the same thing). Measured on the 2-core CI machine, with
`pytest --durations=0`: the figures are in docs/ci.md.
"""

from __future__ import annotations

LONG: dict[str, tuple[str, str]] = {
    "tests/test_zoo.py::test_every_mutant_is_killed": (
        "the zoo's selftest: all 88 mutants searched for at 600 x their budget (its shared fixture alone is ~450 s)",
        "the same-verdict corpus replays a killing trace of 57 mutants and the model passing it; every directed "
        "mutant's trace breaks the rule it names (test_zoo.py's other tests)",
    ),
    "tests/test_zoo.py::test_counterexamples_are_short": ("the selftest's report", "as above"),
    "tests/test_zoo.py::test_unmodified_model_passes_the_same_cells": ("the selftest's report", "as above"),
    "tests/test_zoo.py::test_directed_mutants_are_killed_by_their_traces": (
        "the selftest's report",
        "test_directed_trace_breaks_the_rule_it_names, per mutant, without the report",
    ),
    "tests/test_upstream.py::test_the_reproducer_fails_released_and_passes_fixed": (
        "each upstream reproducer runs in the engine's own test style in a fresh process, released then fixed "
        "(20-40 s each)",
        "test_known_findings.py replays every finding's trace on the engine as shipped and with its fix",
    ),
    "tests/test_served_sglang.py::test_a_stock_sglang_server_someone_else_runs": (
        "a second served SGLang (attached by URL)",
        "the served kvcert backend run (priorities, sessions, host tier, metrics, the twin, the event stream)",
    ),
    "tests/test_served_sglang.py::test_a_bug_planted_in_the_backend_fails_the_rule_it_breaks": (
        "a served SGLang per planted bug (45-75 s each)",
        "test_served.py judges the end-to-end rules on recorded conversations without a server",
    ),
    "tests/test_served_vllm.py::": (
        "vLLM served on the CPU with the tiny model, two runs (80-90 s each)",
        "the served SGLang run; vLLM's scheduler itself through its request path (test_vllm_requests.py)",
    ),
    "tests/test_sglang_decode.py::test_a_planted_bug_fails_under_the_rule_it_breaks": (
        "certifications of the decode server with a bug planted (30-90 s each)",
        "the unmodified decode server certified, its host and storage cells, the planted prefetch bug",
    ),
    "tests/test_sglang_decode.py::test_at_the_default_reserve_a_finished_request_is_not_counted_retractable": (
        "the decode server at SGLang's default reserve (~85 s)",
        "the finding's saved trace replays in test_known_findings.py",
    ),
    "tests/test_sglang_linker.py::test_each_planted_wrapper_bug_fails_certification_under_its_rule[results-lifo]": (
        "certification until the plant fails (~65 s)",
        "the unmodified linker path certified, and the offload-unpinned plant",
    ),
    "tests/test_sglang_linker.py::test_each_planted_wrapper_bug_fails_certification_under_its_rule[hit-past-lookup]": (
        "as above (~25 s)",
        "as above",
    ),
    "tests/test_sglang_linker.py::test_each_planted_wrapper_bug_fails_certification_under_its_rule[stored-on-failure]": (
        "as above (~25 s)",
        "as above",
    ),
    "tests/test_vllm_requests.py::test_the_unmodified_engine_is_certified_on_a_run_that_reaches_the_races[factory_": (
        "vLLM's scheduler certified on its async, hybrid, priority and connector cells, once per cell and with each "
        "planted bug (30-75 s a cell: the plants' tests share the cell's runs, so they are long with it)",
        "the plain cell certified, and every plant on it fails under its rule",
    ),
    "tests/test_vllm_requests.py::test_a_planted_bug_fails_under_the_rule_it_breaks[factory_": ("as above", "as above"),
    "tests/test_vllm_requests.py::test_the_connector_branches_run_through_vllms_scheduler": (
        "the connector cell's run, as above",
        "the connector cell's determinism across processes",
    ),
    "tests/test_vllm_requests.py::test_the_same_seed_gives_the_same_run_in_any_process[factory_async-10]": (
        "a second process of vLLM's scheduler (~20 s)",
        "the same check on the connector cell",
    ),
    "tests/test_refaware_requests.py::test_a_trace_found_with_fixes_replays_with_them": (
        "a certification with the fork's fixes applied, then its replay (~15 s)",
        "every fork fix makes its findings' traces pass (test_known_findings.py)",
    ),
    "tests/test_refaware.py::test_the_device_adapter_certifies_the_same_under_two_hash_seeds": (
        "two certifications of the fork's device cache in fresh processes (~45 s)",
        "the fork's adapters certified in-process, and determinism under hash seeds on kvcert's own caches",
    ),
    "tests/test_refaware_requests.py::test_clients_that_release_one_shot_rids_leave_the_fork_nothing_q4_would_keep": (
        "the fork's scheduler certified with releasing clients (~27 s)",
        "the fork's request path certified, and Q4's trace replayed",
    ),
    "tests/test_pages.py::test_crosshair_gate_fails_on_a_broken_contract": (
        "CrossHair run on a planted broken contract (~30 s)",
        "the CrossHair gate itself over spec/pages.py, spec/storage.py and spec/offload.py",
    ),
    "tests/test_sglang_hicache_storage.py::test_storage_cells_are_certified[factory_rust_storage]": (
        "the storage cells again on the Rust tree core (~30 s)",
        "the storage cells on the Python core",
    ),
    "tests/test_sglang_hicache_certify.py::test_hicache_is_certified[factory_rust": (
        "HiCache certified on the Rust tree core, both layouts (~12 s each)",
        "HiCache certified on the Python core, both layouts",
    ),
    "tests/test_sglang_adapter.py::test_short_certification_passes[16]": (
        "SGLang's RadixCache certified at 16-token pages (~12 s)",
        "the same at 1- and 4-token pages",
    ),
    "tests/test_partition.py::test_the_cases_catch_a_vllm_that_mixes_its_keys": (
        "vLLM probes with a key dropped, each run over every case (~8 s each)",
        "vLLM's manager and scheduler keep keys apart on every case; planted broken caches fail the rule they break",
    ),
}
"""Node-id prefix -> (why it is long, what CI keeps of it)."""
