"""Host syncs per step of ``mixprec.GradScaler`` beside ``torch.amp.GradScaler``, on finite and inf steps.

torch syncs once per non-fused step (``found_inf.item()`` in ``_maybe_opt_step``) and never with a fused
optimizer, whose kernel skips by itself. mixprec must sync no more, on every path: foreach, fused and
single-tensor (``foreach=False``) AdamW, with and without an explicit ``unscale_``, under every rule
setting that reads something on the host (hysteresis, min/max scale, headroom, ``raise_at_min_scale``,
the skip-run warning). The recorder answers every synced CUDA value as the step's outcome: 0.0 on a
finite step, 1.0 (found_inf set, the step skipped) on an inf step (``Recorder.overflow``).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import mixprec
from fake_cuda import loops
from fake_cuda.harness import Recorder
from mixprec.scaling import DynamicScale, StaticScale

pytestmark = pytest.mark.skipif(torch.version.cuda is None, reason="needs a CUDA build of torch (fake tier)")

INNER = {"foreach": {"foreach": True}, "fused": {"fused": True}, "single-tensor": {"foreach": False}}
SCALERS: dict[str, Callable[[], mixprec.GradScaler]] = {
    "default": lambda: mixprec.GradScaler("cuda"),
    "hysteresis=2": lambda: mixprec.GradScaler("cuda", hysteresis=2),
    "min/max scale": lambda: mixprec.GradScaler("cuda", min_scale=1.0, max_scale=2.0**20),
    "headroom": lambda: mixprec.GradScaler("cuda", growth="headroom"),
    "raise_at_min_scale": lambda: mixprec.GradScaler("cuda", rule=DynamicScale(raise_at_min_scale=True)),
    "no restart": lambda: mixprec.GradScaler("cuda", rule=DynamicScale(underflow_restart=False)),
    "static": lambda: mixprec.GradScaler("cuda", rule=StaticScale(1024.0)),
    "no warning": lambda: mixprec.GradScaler("cuda", warn_after_skips=None),
}
# finite, inf, inf, finite: a skip after a clean step, a skip after a skip, a clean step after a skip
PATTERN = (False, True, True, False)


def _syncs_per_step(recorder: Recorder, scaler: object, inner: str, unscale: bool) -> list[int]:
    """Each step's host syncs: ``scale -> (grads) -> [unscale_] -> step -> update`` with AdamW."""
    ps = loops.params()
    opt = torch.optim.AdamW(ps, lr=1e-3, **INNER[inner])
    counts = []
    for overflow in PATTERN:
        recorder.reset()
        recorder.overflow = overflow
        loss = sum(p.float().sum() for p in ps)
        loops._set_grads(ps, scaler.scale(loss))
        if unscale:
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        counts.append(recorder.host_syncs())
    recorder.overflow = False
    return counts


@pytest.mark.parametrize("unscale", [False, True], ids=["step", "unscale_+step"])
@pytest.mark.parametrize("inner", list(INNER))
@pytest.mark.parametrize("setting", list(SCALERS))
def test_mixprec_syncs_no_more_than_torch_on_finite_and_inf_steps(
    fake_hopper, setting, inner, unscale
) -> None:
    if inner == "fused" and setting == "headroom":
        pytest.skip("HeadroomScale reads amax every step: a fused optimizer gets the scaler's own pass")
    theirs = _syncs_per_step(fake_hopper, torch.amp.GradScaler("cuda"), inner, unscale)
    ours = _syncs_per_step(fake_hopper, SCALERS[setting](), inner, unscale)
    assert theirs == ([0] * len(PATTERN) if inner == "fused" else [1] * len(PATTERN))
    assert ours == theirs, f"mixprec {ours} vs torch {theirs} host syncs per step ({PATTERN} inf)"


def test_a_long_run_of_inf_steps_still_syncs_once_per_step(fake_hopper) -> None:
    # Once the run of skips may have reached warn_after_skips, the run counter is read in the skip
    # decision's one sync (tests/scaling/test_scaler_extras.py checks that the warning fires).
    scaler = mixprec.GradScaler("cuda", warn_after_skips=3)
    ps = loops.params()
    opt = torch.optim.AdamW(ps, lr=1e-3, foreach=True)
    fake_hopper.overflow = True
    counts = []
    for _ in range(6):
        fake_hopper.reset()
        loops._set_grads(ps, scaler.scale(sum(p.float().sum() for p in ps)))
        scaler.step(opt)
        scaler.update()
        counts.append(fake_hopper.host_syncs())
    fake_hopper.overflow = False
    assert counts == [1] * 6
