"""The HF benchmark suite runs end to end at a smoke size and gives every case a shardkit row (no time asserted)."""

import pytest

pytest.importorskip("transformers")
pytest.importorskip("huggingface_hub")

import shardkit.bench.hf_suites.hf_bench as hf_bench  # noqa: E402


def test_hf_bench_runs_and_every_case_has_a_shardkit_row(tmp_path, monkeypatch):
    monkeypatch.setattr(hf_bench, "LLAMA_MIN_BYTES", 4 << 20)
    rows = hf_bench.run_hf_benchmarks(1 << 20, 1, str(tmp_path))
    cases = dict.fromkeys(r["case"] for r in rows)
    assert {"hf load, Llama, built on meta", "hf load, Llama on meta, pages touched", "hf load into allocated Llama",
            "hf save, Llama, fsync'd", "hf save, Llama, no fsync", "hf load as dict, lazy map",
            "hf load as dict, pages touched", "hf load into allocated module"} <= set(cases)
    for case in cases:
        assert [r["impl"] for r in rows if r["case"] == case].count("shardkit") == 1, case
    assert all(r["median_s"] > 0 for r in rows)
