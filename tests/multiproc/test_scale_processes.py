"""Scale on process ranks (issue 13): the rows the benchmark fits, measured with each rank a process.

The counts rank 0 sees must be the thread ranks' counts: the protocol does
not depend on how ranks run. No timing is asserted.
"""

from __future__ import annotations

from shardkit.bench.checkpoint_suites.scale_bench import format_scale_table, measure, measure_as
from shardkit.bench.checkpoint_suites.scale_processes import measure_processes
from shardkit.checkpoint.saving.chunked_save import ROUND_SLOTS

#: Each round of a save is a gather to rank 0 and a broadcast of its verdict.
COLLECTIVES_PER_SAVE = 2 * len(ROUND_SLOTS)


def test_process_ranks_count_what_thread_ranks_count(tmp_path):
    procs = measure_processes(6, 4, str(tmp_path))
    threads = measure(6, 4, str(tmp_path))
    assert procs["rank0_collectives"] == threads["rank0_collectives"] == COLLECTIVES_PER_SAVE
    for key in ("rank0_recv_bytes", "rank0_sent_bytes", "rank0_exchanges", "metadata_bytes"):
        assert procs[key] == threads[key], key
    assert procs["ranks_save_cpu_s"] >= procs["rank0_save_cpu_s"] > 0
    assert procs["load_s"] > 0 and procs["exchanges_wall_s"] > 0


def test_a_table_of_process_rows_fits_an_exponent(tmp_path):
    rows = [measure_as("processes", n, 2, str(tmp_path)) for n in (2, 4)]
    assert all(r["ranks_as"] == "processes" for r in rows)
    table = format_scale_table(rows)
    assert table.splitlines()[-1].startswith("exponent")


def test_the_control_compares_one_job_with_many_jobs_at_once(tmp_path):
    from shardkit.bench.checkpoint_suites.scale_processes import per_rank_cpu_one_job_vs_many

    row = per_rank_cpu_one_job_vs_many(2, 2, 2, str(tmp_path))
    assert row["processes"] == 4
    assert all(row[k] > 0 for k in row if k.endswith("_s"))
