"""DeviceGroup validation runs (and is tested) without any GPU."""

import pytest
import torch

from shardkit.comm import DeviceGroup
from shardkit.comm.device_group import validate_devices
from shardkit.errors import InvalidRankError, UnsupportedOpError


@pytest.mark.parametrize("devices", [["cpu", "cpu"], ["cuda:0", "cpu"], [torch.device("cpu")]])
def test_cpu_devices_are_refused(devices):
    with pytest.raises(UnsupportedOpError, match="CUDA devices"):
        DeviceGroup(devices)


@pytest.mark.parametrize("devices", [["cuda:0"], ["cuda:1", "cuda:1"], [], ["cuda", "cuda:0"]])
def test_fewer_than_two_distinct_cuda_devices_are_refused(devices):
    with pytest.raises(InvalidRankError, match="at least 2 distinct"):
        DeviceGroup(devices)


def test_valid_list_is_normalised():
    assert validate_devices([0, "cuda:1"]) == [torch.device("cuda", 0), torch.device("cuda", 1)]


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine has the devices")
def test_missing_devices_are_reported():
    with pytest.raises(UnsupportedOpError, match="CUDA device"):
        DeviceGroup(["cuda:0", "cuda:1"])
