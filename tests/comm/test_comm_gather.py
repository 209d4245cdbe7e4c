"""``Group.gather``: the root gets every rank's tensor in rank order, the others None (Gloo threads)."""

from __future__ import annotations

import pytest
import torch

from comm_threads import on_threads
from shardkit.comm import Group
from shardkit.errors import InvalidRankError

N = 3


@pytest.fixture(scope="module")
def groups():
    gs = Group.local(N, timeout=20)
    yield gs
    for g in gs:
        g.close()


@pytest.mark.parametrize("root", [0, 2])
def test_gather_gives_the_root_every_rank_in_order_and_the_others_none(groups, root):
    got = on_threads(groups, lambda g: g.gather(torch.tensor([[g.rank, 10 + g.rank]], dtype=torch.int16), root))
    for r, out in enumerate(got):
        if r == root:
            assert [t.tolist() for t in out] == [[[q, 10 + q]] for q in range(N)]
            assert all(t.dtype == torch.int16 for t in out)
        else:
            assert out is None


def test_gather_refuses_a_root_outside_the_group(groups):
    with pytest.raises(InvalidRankError, match=r"root 3 is not a rank of this group; valid ranks are 0\.\.2"):
        groups[0].gather(torch.zeros(1), 3)
