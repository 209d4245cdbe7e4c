"""The GPU-tensor rule, checked without CUDA: routing decisions and the warning mechanics."""

import warnings

import pytest
import torch

from shardkit.comm import FALLBACK_ENV, GpuFallbackWarning
from shardkit.comm.gpu_policy import choose_route, fallback_enabled, host_round_trip
from shardkit.errors import CommArgumentError, UnsupportedOpError

CUDA = [torch.device("cuda", 0)]


def test_cpu_tensors_are_native_everywhere():
    assert choose_route([torch.device("cpu")], "gloo", "x") == "native"


def test_cuda_on_nccl_is_native():
    assert choose_route(CUDA, "nccl", "all_reduce_") == "native"


def test_cuda_on_gloo_errors_naming_the_variable(monkeypatch):
    monkeypatch.delenv(FALLBACK_ENV, raising=False)
    with pytest.raises(UnsupportedOpError, match=FALLBACK_ENV) as e:
        choose_route(CUDA, "gloo", "all_reduce_")
    assert "all_reduce_" in str(e.value) and "nccl" in str(e.value)


@pytest.mark.parametrize("value,enabled", [("1", True), ("true", True), ("0", False), ("off", False), ("", False)])
def test_variable_is_read_at_call_time(monkeypatch, value, enabled):
    monkeypatch.setenv(FALLBACK_ENV, value)
    assert fallback_enabled() is enabled
    if enabled:
        assert choose_route(CUDA, "gloo", "broadcast_") == "host"
    else:
        with pytest.raises(UnsupportedOpError):
            choose_route(CUDA, "gloo", "broadcast_")


def test_mixed_devices_are_refused():
    with pytest.raises(CommArgumentError, match="mixed"):
        choose_route([torch.device("cpu"), torch.device("cuda", 0)], "nccl", "x")


def test_other_device_types_are_refused():
    with pytest.raises(UnsupportedOpError, match="meta"):
        choose_route([torch.device("meta")], "gloo", "x")


def test_round_trip_warns_on_every_call_and_copies_back():
    # The mechanics on CPU tensors: the real CUDA case is in tests/gpu.
    t = torch.ones(3)
    with warnings.catch_warnings(record=True) as caught:
        for _ in range(2):
            host_round_trip([t], "all_reduce_", lambda hs: hs[0].mul_(2))
    assert t.tolist() == [4.0, 4.0, 4.0]
    fallbacks = [w for w in caught if issubclass(w.category, GpuFallbackWarning)]
    assert len(fallbacks) == 2 and FALLBACK_ENV in str(fallbacks[0].message)


def test_round_trip_copies_back_only_what_the_collective_writes():
    # reduce_scatter's input may be a parameter or an expanded view: it is read, never written
    weight = torch.nn.Parameter(torch.ones(4))
    expanded = torch.ones(1).expand(4)
    out = torch.zeros(2)
    with warnings.catch_warnings(record=True):
        for source in (weight, expanded):
            host_round_trip([source, out], "reduce_scatter", lambda hs: (hs[0].mul_(3), hs[1].fill_(5)), written=(1,))
            assert source.tolist() == [1.0] * 4 and out.tolist() == [5.0, 5.0]
        host_round_trip([weight], "broadcast_", lambda hs: hs[0].fill_(2))  # a parameter written in place
    assert weight.tolist() == [2.0] * 4 and weight.requires_grad


def test_round_trip_warns_twice_under_pythons_default_filter():
    t = torch.ones(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # normally: once per call site
        for _ in range(2):
            host_round_trip([t], "broadcast_", lambda hs: None)
    hits = [w for w in caught if issubclass(w.category, GpuFallbackWarning)]
    assert len(hits) == 2 and hits[0].filename == __file__  # blamed on the caller, not shardkit


def test_user_can_still_silence_it():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("ignore", GpuFallbackWarning)
        host_round_trip([torch.ones(1)], "broadcast_", lambda hs: None)
    assert not caught
