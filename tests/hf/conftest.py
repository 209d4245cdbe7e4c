import os

import pytest
import torch

# Nothing in these tests may reach the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from hf_helpers import Tied  # noqa: E402


@pytest.fixture
def tied_model():
    torch.manual_seed(1)
    return Tied()
