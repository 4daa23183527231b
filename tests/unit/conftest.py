"""Fixtures of the one-process unit tests."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch.distributed as dist


@pytest.fixture
def world1():
    """A world-size-1 gloo process group for the test (destroyed after it): the collectives' math in one process."""
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(d, 'store')}", rank=0, world_size=1)
        try:
            yield dist.group.WORLD
        finally:
            dist.destroy_process_group()
