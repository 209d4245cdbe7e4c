"""Scale (issue 13): rank 0's commit traffic against ranks x tensors, on Group.local thread ranks.

Every rank saves ``tensors`` sharded tiny tensors (``rank_state``: each is a
``(ranks, 4)`` tensor with one chunk per rank, the layout FSDP gives) and
``tensors`` replicated ones. Rank 0 must issue a constant number of
collectives per save, whatever ranks and tensors are, and receive bytes
linear in ranks x tensors (no more than the metadata it writes, which holds
ranks x tensors chunk records). No timing is asserted; the benchmark
(``shardkit bench --only scale``) reports the times.
"""

from __future__ import annotations

import pytest

from shardkit.bench.scale_bench import close_all, growth_exponent, load_one, measure, save_counted
from shardkit.checkpoint.manifest import read_manifest
from shardkit.comm import Group
from shardkit.storage import storage_for

#: 4 exchanges per save (prepare, withdraw, write, commit), each two all-gathers (lengths, payloads).
COLLECTIVES_PER_SAVE = 8


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    work = str(tmp_path_factory.mktemp("scale"))
    return {(r, t): measure(r, t, work) for r, t in ((8, 4), (8, 16), (32, 4))}


@pytest.mark.parametrize("ranks,tensors", [(8, 4), (8, 16), (32, 4)])
def test_rank0_issues_a_constant_number_of_collectives(rows, ranks, tensors):
    row = rows[(ranks, tensors)]
    assert row["rank0_collectives"] == COLLECTIVES_PER_SAVE
    assert row["rank0_exchanges"] == COLLECTIVES_PER_SAVE // 2


@pytest.mark.parametrize("ranks,tensors", [(8, 4), (8, 16), (32, 4)])
def test_rank0_receives_bytes_linear_in_ranks_times_tensors(rows, ranks, tensors):
    row = rows[(ranks, tensors)]
    # Every rank reports a box per tensor (~60 bytes of JSON each): c * ranks * (2 * tensors) plus a
    # per-rank constant (its file record and status).
    assert row["rank0_recv_bytes"] <= 100 * ranks * (2 * tensors) + 1000 * ranks
    # Rank 0 receives no more than the metadata.json it writes (ranks x tensors chunk records).
    assert row["rank0_recv_bytes"] <= row["metadata_bytes"]


def test_growth_is_no_worse_than_linear(rows):
    xs = [r * t for r, t in rows]
    for column in ("rank0_recv_bytes", "metadata_bytes"):
        # Slope of log(column) on log(ranks x tensors): 1 is linear; allow slack for constant terms.
        assert growth_exponent(xs, [row[column] for row in rows.values()]) <= 1.15, column


def test_metadata_holds_one_chunk_per_rank_per_sharded_tensor(tmp_path):
    ranks, tensors = 8, 3
    groups = Group.local(ranks)
    try:
        save_counted(groups, tensors, str(tmp_path), join_timeout_s=120)
        assert load_one(groups[5], tensors, str(tmp_path)) >= 0      # checks the loaded values
    finally:
        close_all(groups)
    m = read_manifest(*storage_for(str(tmp_path)))
    assert m.num_ranks == ranks
    assert [len(m.tensors[f"__rank_state__.shard{i}"].chunks) for i in range(tensors)] == [ranks] * tensors
    assert [len(m.tensors[f"model.w{i}"].chunks) for i in range(tensors)] == [1] * tensors   # written once
