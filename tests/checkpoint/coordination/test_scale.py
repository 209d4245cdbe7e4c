"""Scale (issue 13): rank 0's commit traffic against ranks x tensors, on Group.local thread ranks.

Every rank saves ``tensors`` sharded tiny tensors (``rank_state``: each is a
``(ranks, 4)`` tensor with one chunk per rank, the layout FSDP gives) and
``tensors`` replicated ones. Rank 0 must issue a constant number of
collectives per save, whatever ranks and tensors are, and receive O(ranks +
tensors) bytes: every rank sends a digest of the layout and its file record,
never a box or a byte range per tensor (``metadata.json``, which lists
ranks x tensors chunks, is computed by rank 0); what rank 0 sends (its
verdicts) does not grow at all. No timing is asserted; the benchmark
(``shardkit bench --only scale``) reports the times.
"""

from __future__ import annotations

import pytest

from shardkit.bench.checkpoint_suites.scale_bench import close_all, growth_exponent, load_one, measure, save_counted
from shardkit.checkpoint.coordination.group import BROADCAST_SLOT_BYTES
from shardkit.checkpoint.format.manifest import read_manifest
from shardkit.comm import Group
from shardkit.storage import storage_for

#: 3 rounds per save (prepare; withdraw; write and commit), each a gather to rank 0 and a broadcast.
COLLECTIVES_PER_SAVE = 6


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    work = str(tmp_path_factory.mktemp("scale"))
    return {(r, t): measure(r, t, work) for r, t in ((8, 4), (8, 16), (32, 4))}


@pytest.mark.parametrize("ranks,tensors", [(8, 4), (8, 16), (32, 4)])
def test_rank0_issues_a_constant_number_of_collectives(rows, ranks, tensors):
    row = rows[(ranks, tensors)]
    assert row["rank0_collectives"] == COLLECTIVES_PER_SAVE
    assert row["rank0_exchanges"] == COLLECTIVES_PER_SAVE // 2
    # Rank 0's own input: its status in each gather and its verdict in each broadcast, whatever the ranks.
    assert row["rank0_sent_bytes"] == rows[(8, 4)]["rank0_sent_bytes"] <= 3 * (256 + BROADCAST_SLOT_BYTES)


#: What one rank sends rank 0 per save on the agreed path (3 gathers of one fixed slot each, length
#: included: statuses with a layout digest 160, an error 32, a file record 256), 448 bytes; the bound
#: leaves room, and allows a little per tensor although nothing per tensor is sent.
BYTES_PER_RANK = 600
BYTES_PER_TENSOR = 8


@pytest.mark.parametrize("ranks,tensors", [(8, 4), (8, 16), (32, 4)])
def test_rank0_receives_bytes_linear_in_ranks_plus_tensors(rows, ranks, tensors):
    row = rows[(ranks, tensors)]
    assert row["rank0_recv_bytes"] <= BYTES_PER_RANK * ranks + BYTES_PER_TENSOR * (2 * tensors)
    # Version 2 listed ranks x tensors chunk records, more than rank 0 received; version 3's grid entries
    # keep metadata.json O(ranks + tensors) too (a file record per rank, a grid per tensor).
    assert row["metadata_bytes"] <= BYTES_PER_RANK * ranks + 200 * tensors


def test_rank0_receives_the_same_bytes_per_rank_whatever_the_tensors(rows):
    per_rank = [row["rank0_recv_bytes"] / (r - 1) for (r, _), row in rows.items()]
    assert max(per_rank) <= 1.1 * min(per_rank), per_rank
    # Four times the tensors on 8 ranks: (almost) the same bytes.
    assert growth_exponent([4, 16], [rows[(8, 4)]["rank0_recv_bytes"], rows[(8, 16)]["rank0_recv_bytes"]]) <= 0.1


def test_growth_against_ranks_times_tensors(rows):
    xs = [r * t for r, t in rows]
    # Slope of log(column) on log(ranks x tensors): 1 is linear. metadata.json (version 2 listed every chunk) is at most linear;
    # rank 0's traffic grows with ranks only, so over these rows its slope is far below 1 (~0.55).
    assert growth_exponent(xs, [row["metadata_bytes"] for row in rows.values()]) <= 1.15
    assert growth_exponent(xs, [row["rank0_recv_bytes"] for row in rows.values()]) <= 0.75


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
