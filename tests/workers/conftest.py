"""Fixtures of the worker and engine tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def one_torch_thread():
    """Run the model on one thread: tests share a small machine, where more threads only contend."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
