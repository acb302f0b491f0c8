"""Fixtures: GPU detection, NaN-poisoned GPU allocations, fresh random generators."""

import zlib

import numpy as np
import pytest
from support import HAS_GPU, poison_gpu_allocations


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="no CUDA GPU available")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng(request):
    """A generator seeded from the test's name: fresh per test, reproducible."""
    seed = zlib.crc32(request.node.nodeid.encode())
    return np.random.default_rng(seed)


@pytest.fixture
def poisoned():
    """Every CuPy allocation during the test starts filled with NaN."""
    undo = poison_gpu_allocations()
    yield
    undo()
