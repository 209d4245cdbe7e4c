"""DTensor placements whose local parts are not one box per rank are refused, never half-loaded.

Found by review: a load into ``(Shard(0), _StridedShard(0, 2))`` on a 2x2 mesh,
where a rank holds interleaved rows, filled the first rows instead, without
an error (torch's shape helper gives only the first offset); an unknown
placement was saved as if replicated, keeping one rank's values; a rank
outside a DTensor's mesh could not load.
"""

from __future__ import annotations

import pytest

import shardkit.checkpoint as ckpt
from placement_jobs import FULL, interleaved_strided, outside_the_mesh, unknown_placement
from ranks import run_ranks

pytestmark = pytest.mark.multiproc


def test_an_interleaved_strided_layout_is_refused_on_load_and_on_save(tmp_path):
    ckpt.save({"w": FULL}, tmp_path / "saved")
    results = run_ranks(interleaved_strided, 4, tmp_path, str(tmp_path / "saved"), str(tmp_path / "fresh"))
    for load_error, untouched, save_error, written in results:
        assert load_error is not None and "not one contiguous box" in load_error
        assert untouched
        assert save_error is not None and "not one contiguous box" in save_error
        assert written == []


def test_an_unknown_placement_is_refused_before_anything_is_written(tmp_path):
    for error, written in run_ranks(unknown_placement, 4, tmp_path, str(tmp_path / "fresh")):
        assert error is not None and "cannot lay out" in error and "Unknown" in error
        assert written == []


def test_ranks_outside_a_dtensors_mesh_load_nothing_and_the_others_their_rows(tmp_path):
    ckpt.save({"w": FULL}, tmp_path / "saved")
    got = run_ranks(outside_the_mesh, 4, tmp_path, str(tmp_path / "saved"))
    assert got[0] == FULL[:4].tolist() and got[1] == FULL[4:].tolist()
    assert got[2] == [] and got[3] == []
