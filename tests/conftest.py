"""Session-wide test settings."""

from __future__ import annotations

import os

import torch

# The tests use tiny tensors: intra-op threads only add contention (10-20x slower on a busy 2-core
# machine). MIXPREC_TEST_THREADS overrides.
torch.set_num_threads(int(os.environ.get("MIXPREC_TEST_THREADS", "1")))

# torch.compile's on-disk cache does not key its CPU kernels by ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA:
# kernels cached under another kernel set give NaN or corrupt the heap (measured with torch 2.13 under
# ATEN_CPU_CAPABILITY=avx2, both ways). A run with a restricted kernel set gets a cache of its own.
_KERNEL_SET = "-".join(os.environ.get(v, "") for v in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA"))
if _KERNEL_SET.strip("-") and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    import getpass
    import tempfile

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
        tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_{_KERNEL_SET.lower()}"
    )
