"""Session-wide test settings."""

from __future__ import annotations

import os

import torch

# The tests use tiny tensors: intra-op threads only add contention (10-20x slower on a busy 2-core
# machine). MIXPREC_TEST_THREADS overrides.
torch.set_num_threads(int(os.environ.get("MIXPREC_TEST_THREADS", "1")))
