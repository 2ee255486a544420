"""Fixtures for the mixprec.inspect tests: one intra-op thread (tiny fp16 kernels on a busy CPU)."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny matmuls spend their time in thread hand-offs when the CPU is shared; one thread is ~100x faster.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
