"""fp32 master weights behind a half-precision model: :class:`MixedPrecisionOptimizer`.

In fp16 ``1 + 1e-4 == 1`` (in bf16 even ``1 + 1e-3 == 1``): an update smaller than half the gap to a weight's
neighbour is rounded away, so a half-precision model that steps its own weights stalls. The cure (Micikevicius
et al. 2018; apex's ``FP16_Optimizer``) keeps an fp32 master copy of every half-precision parameter and lets
the optimizer step the masters. One iteration::

    backward(loss):  (loss * scale).backward()          # scaled grads land on the half-precision params
    step():
        masters <- model weights where those changed outside the optimizer (load_state_dict, edits)
        master.grad <- fp32(param.grad)                  # exists during step() only
        scaler.unscale_(inner)                           # master.grad /= scale, found_inf recorded
        scaler.step(inner)                               # inner.step() on the masters unless found_inf
                                                         # or a |g| whose square overflows the state
        scaler.update()                                  # back off after inf/nan, grow after a clean run
        param <- half(master)                            # one foreach copy (a no-op after a skipped step)

The fp32 gradients live only inside ``step()`` (and between ``clip_master_grads`` and ``step``): with Adam
an O2 model holds 16 bytes per parameter (2 weight, 2 gradient, 4 master, 8 state), as much as fp32 training.
Parameters that already are fp32 (BatchNorm kept fp32, or every parameter under O1) are their own masters.
The skip decision is the only host sync, inside ``scaler.step``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.optim import Optimizer

from mixprec.optim.guard import HugeGradientGuard
from mixprec.optim.sharding import local
from mixprec.optim.state import load_mixed_precision_state
from mixprec.optim.wrapper import (
    LOW_PRECISION_DTYPES,
    OptimizerWrapper,
    ScalerView,
    check_state_format,
    first_device,
    resolve_scaler,
)
from mixprec.scaling import GradScaler
from mixprec.scaling.rules import GradScalerError

__all__ = ["MixedPrecisionOptimizer"]

_STATE_KEYS = ("optimizer", "master_params", "scaler")


class MixedPrecisionOptimizer(OptimizerWrapper):
    """Loss scaling and fp32 master weights around a torch optimizer whose params may be half precision.

    The wrapped optimizer is taken over: in its ``param_groups`` every fp16/bf16 parameter is replaced by an
    fp32 master copy (existing optimizer state moves to the master, cast to fp32). ``param_groups`` of the
    wrapper are those groups, so LR schedulers and per-group options work on the wrapper unchanged.

    The masters follow the model: when a model weight changes outside this optimizer (``load_state_dict``,
    an in-place edit under ``no_grad``, ``param.data = ...``), the elements that no longer equal their
    master's rounding are copied to the master before the next step or ``state_dict``. An in-place edit of
    ``param.data`` bypasses the tensor's version counter; call :meth:`sync_masters` after one. The groups
    may be edited as a torch optimizer's: a half-precision param given to :meth:`add_param_group`, or
    appended to ``param_groups[i]["params"]`` by hand, gets its master at once or before the next step.

    With a scaler, a step whose unscaled gradients hold a value whose square overflows the optimizer
    state's dtype (``|g| > 1.8e19`` for fp32 state) is skipped and counted in :attr:`skipped_steps`, with a
    ``RuntimeWarning`` (``mixprec.optim.guard``); Kahan/stochastic inner updates are not guarded here.

    Args:
        optimizer: a torch optimizer built on the model's parameters.
        scaler: None (no scaling), ``"dynamic"`` (default, mixprec's GradScaler), a number (static scale) or
            a GradScaler-like object.
        master_weights: keep fp32 copies of half-precision params (True), or step them in place (False, apex
            O3 / "bf16-true").
        state_format: None (the inner optimizer's own state and step) or ``"bf16"``, ``"int8"``, ``"fp8"``:
            Adam's moments stored in that low-bit format (``mixprec.optim.state_formats``) and the masters
            stepped chunk by chunk through torch's fused kernel (``mixprec.optim.fused_adam``, the step
            counters on the masters' device; on CUDA one Triton pass per master instead, bit for bit the
            same, ``mixprec.optim._triton_adam``); needs a fresh ``torch.optim.Adam``/``AdamW`` (any
            foreach/fused/capturable flag). A chunk is at most ``rounding.CHUNK`` (2**18) values on a CPU
            and ``rounding.CUDA_CHUNK`` (2**24) on a CUDA device; the step's workspace holds three fp32
            buffers of a chunk (gradients, both moments: 192 MiB on a GPU) and allocates up to 8 bytes
            per value of a tensor's slice of the chunk for the moment it is encoding.

    Raises:
        TypeError: ``optimizer`` is not an Optimizer or is already a MixedPrecisionOptimizer;
            ``master_weights`` is not a bool.
        ValueError: for an unknown scaler spec or ``state_format``, or a ``state_format`` with an optimizer
            other than a fresh Adam/AdamW.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        *,
        scaler: Any = "dynamic",
        master_weights: bool = True,
        state_format: str | None = None,
    ) -> None:
        if isinstance(optimizer, MixedPrecisionOptimizer):
            raise TypeError("optimizer is already a MixedPrecisionOptimizer; wrap the inner optimizer once")
        if not isinstance(optimizer, Optimizer):
            raise TypeError(
                f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}: {optimizer!r}"
            )
        if not isinstance(master_weights, bool):
            raise TypeError(f"master_weights must be True or False, got {master_weights!r}")
        check_state_format(optimizer, state_format)
        resolved = resolve_scaler(scaler, first_device(optimizer).type)
        super().__init__(optimizer)
        self.master_weights = master_weights
        self.state_format = state_format
        self.model_params: list[torch.Tensor] = []
        self.master_params: list[torch.Tensor] = []
        self.scaler = resolved
        self._scaler_view = ScalerView(optimizer, _guard_for(optimizer, resolved), state_format)
        self._grads_ready = False
        self._seen: list[tuple[int, int]] = []
        self._stepped: list[torch.Tensor] = []  # what the groups held at the last adoption
        for group in optimizer.param_groups:
            self._adopt(group)

    def _adopt(self, group: dict[str, Any]) -> None:
        group["params"] = [self._master_for(p) for p in group["params"]]
        self._record()
        self._stepped = self._held()

    def _held(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def _master_for(self, param: torch.Tensor) -> torch.Tensor:
        if not (self.master_weights and param.dtype in LOW_PRECISION_DTYPES):
            return param
        # FSDP2: the master is a plain fp32 copy of this rank's shard, so the step never runs DTensor ops.
        master = torch.nn.Parameter(local(param).detach().to(torch.float32, copy=True), param.requires_grad)
        state = self.optimizer.state.pop(param, None)
        if state:
            self.optimizer.state[master] = {
                k: v.float() if torch.is_tensor(v) and v.dtype == param.dtype else v for k, v in state.items()
            }
        self.model_params.append(param)
        self.master_params.append(master)
        return master

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the inner optimizer, with fp32 masters for its half-precision params.

        As in torch, a parameter may be in one group only: a model parameter that already has a master
        (or a master itself) is refused, before anything changes.

        Raises:
            TypeError: ``param_group`` is not a dict with ``"params"``, or holds a non-tensor.
            ValueError: a parameter is already in a group, or given twice.
        """
        if not isinstance(param_group, dict) or "params" not in param_group:
            raise TypeError(f"param_group must be a dict with 'params', got {param_group!r:.80}")
        self._follow_groups()
        params = param_group["params"]
        params = [params] if torch.is_tensor(params) else list(params)
        _check_new_params(params, self.model_params, self._held())
        self.optimizer.add_param_group({**param_group, "params": params})
        self._adopt(self.optimizer.param_groups[-1])

    def _follow_groups(self) -> None:
        """Give half-precision params put into ``param_groups`` by hand their masters (before a step).

        Raises:
            ValueError: a parameter is in two groups (or twice in one), or a model parameter that has a
                master was put in beside it; nothing changes then.
        """
        held = self._held()
        if len(held) == len(self._stepped) and all(a is b for a, b in zip(held, self._stepped, strict=True)):
            return
        known = {id(p) for p in self._stepped}
        _check_new_params(
            [p for p in held if id(p) not in known],
            self.model_params,
            [p for p in held if id(p) in known],
            "param_groups",
        )
        for group in self.param_groups:
            group["params"] = [p if id(p) in known else self._master_for(p) for p in group["params"]]
        self._record()
        self._stepped = self._held()

    def _record(self) -> None:
        self._seen = [(local(p)._version, local(p).data_ptr()) for p in self.model_params]

    def sync_masters(self) -> None:
        """Copy model weights that changed outside the optimizer into their masters (elementwise).

        Where a model weight still equals its master rounded to the weight's dtype, the master keeps its
        fp32 value; elsewhere it becomes the weight. Runs by itself before each step and ``state_dict``
        for every weight whose version counter or storage changed; call it after ``param.data`` edits.

        Raises:
            RuntimeError: a model weight changed shape or dtype (the optimizer cannot follow that).
        """
        with torch.no_grad():
            for param, master in zip(map(local, self.model_params), self.master_params, strict=True):
                if param.shape != master.shape or param.dtype not in LOW_PRECISION_DTYPES:
                    raise RuntimeError(
                        f"a model parameter changed to {param.dtype} {tuple(param.shape)} after initialize; "
                        f"its master is {tuple(master.shape)}: build the optimizer again"
                    )
                changed = param.ne(master.to(param.dtype))
                master.copy_(torch.where(changed, param.float(), master))
        self._record()

    def _follow_model(self) -> None:
        if any(
            (local(p)._version, local(p).data_ptr()) != seen
            for p, seen in zip(self.model_params, self._seen, strict=True)
        ):
            self.sync_masters()

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 without scaling). Reading it syncs with the device."""
        return float(self.scaler.get_scale())

    @property
    def skipped_steps(self) -> int:
        """Steps skipped so far because a gradient was inf/nan (as the scaler counts them; 0 for a scaler
        that does not count) or so large that its square would overflow the optimizer state (the guard, or a
        :class:`~mixprec.optim.compensated.CompensatedOptimizer` inside that checks in its update pass)."""
        guard = self._scaler_view.guard
        inner = int(getattr(self.optimizer, "skipped_steps", 0))
        return int(getattr(self.scaler, "skipped_steps", 0)) + (guard.skipped_steps if guard else 0) + inner

    @property
    def last_step_skipped(self) -> bool:
        """Whether the latest ``step()`` was skipped: step LR schedulers only when it was not."""
        guard = self._scaler_view.guard
        inner = bool(getattr(self.optimizer, "last_step_skipped", False))
        return (
            bool(getattr(self.scaler, "last_step_skipped", False))
            or bool(guard and guard.last_step_skipped)
            or inner
        )

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Scale ``loss`` and run backward; ``kwargs`` go to ``Tensor.backward`` (e.g. ``retain_graph``)."""
        self.scaler.scale(loss).backward(**kwargs)

    def _prepare_grads(self, caller: str) -> None:
        """Give the masters fp32 copies of the model's gradients and unscale them, once per step."""
        if self._grads_ready:
            return
        if _nothing_scaled(self.scaler):
            raise GradScalerError(
                f"MixedPrecisionOptimizer.{caller}() before any optimizer.backward(loss): the loss scaler "
                "has scaled no loss yet, so the gradients (from a plain loss.backward()?) are not scaled and "
                "cannot be unscaled or checked for inf/nan. To compute gradients, call "
                "optimizer.backward(loss) instead of loss.backward() (it scales the loss, then runs "
                "backward; keyword arguments such as retain_graph=True pass through)."
            )
        for param, master in zip(self.model_params, self.master_params, strict=True):
            master.grad = None if param.grad is None else local(param.grad).to(torch.float32)
        self._scaler_view.refresh()
        self.scaler.unscale_(self._scaler_view)
        self._grads_ready = True

    def unscale_grads(self) -> None:
        """Give the params the inner optimizer steps their unscaled gradients now, once per step, as
        ``GradScaler.unscale_`` does: fp32 copies on the masters (which hold them until ``step``), the
        params' own ``.grad`` elsewhere. ``step()`` uses them as they are, so they may be read or clipped
        in between; another backward before ``step()`` does not reach them (see ``grads_unscaled``)."""
        self._prepare_grads("unscale_grads")

    @property
    def grads_unscaled(self) -> bool:
        """Whether :meth:`unscale_grads` (or ``clip_master_grads``) ran since the last step/zero_grad."""
        return self._grads_ready

    def clip_master_grads(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Unscale and clip the gradients the optimizer will use.

        Returns:
            The total norm of the unscaled gradients before clipping, as a tensor (no host sync); inf or nan
            when the step is going to be skipped.
        """
        self._prepare_grads("clip_master_grads")
        params = [p for p in self._scaler_view.param_groups[0]["params"] if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)

    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        """Unscale, skip on inf/nan (the scale backs off), step the masters and copy them to the model.

        Raises:
            GradScalerError: (a RuntimeError) before any :meth:`backward` with an enabled scaler, as after
                a plain ``loss.backward()``; nothing changes (``unscale_grads``, ``clip_master_grads`` too).
        """
        if closure is not None:
            raise ValueError(
                "MixedPrecisionOptimizer.step does not take a closure; call backward(loss) first"
            )
        self._follow_groups()
        self._follow_model()
        try:
            self._prepare_grads("step")
            self.scaler.step(self._scaler_view)
            self.scaler.update()
            if self.model_params:
                shards = [local(p) for p in self.model_params]
                with torch.no_grad():
                    torch._foreach_copy_(shards, self.master_params)
                # a DTensor param changed through its shard: bump its own counter, as torch's in-place ops do
                sharded = [p for p, shard in zip(self.model_params, shards, strict=True) if shard is not p]
                if sharded:
                    torch.autograd.graph.increment_version(sharded)
        finally:
            for master in self.master_params:
                master.grad = None  # the fp32 gradients exist during the step only
            self._grads_ready = False
            self._record()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model's gradients (the masters hold none between steps)."""
        for master in self.master_params:
            master.grad = None
        self._zero_grads(self.model_params, set_to_none)
        self._grads_ready = False

    def state_dict(self) -> dict[str, Any]:
        """Inner optimizer state, fp32 masters (references, as torch does), scaler state and the
        ``state_format`` when one is set."""
        self._follow_groups()
        self._follow_model()
        return self._with_state_format(
            {
                "optimizer": self.optimizer.state_dict(),
                "master_params": [m.detach() for m in self.master_params],
                "scaler": self.scaler.state_dict(),
            }
        )

    def shard_parts(self) -> tuple[dict[str, Any], list[Any], list[Any], str] | None:
        """The inner state belongs to the model params behind the masters, ``master_params`` to
        ``model_params``; None around another wrapper (reshard that one's state instead)."""
        if isinstance(self.optimizer, OptimizerWrapper):
            return None
        behind = {id(m): p for p, m in zip(self.model_params, self.master_params, strict=True)}
        inner = [behind.get(id(p), p) for g in self.param_groups for p in g["params"]]
        return self.state_dict(), inner, list(self.model_params), "master_params"

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved; the model's half-precision weights are set from the masters.

        Everything is validated first (keys, master shapes, the inner optimizer's and the scaler's parts);
        a call that raises leaves the optimizer, the scaler and the model as they were.

        Raises:
            TypeError: ``state_dict`` is not a dict.
            ValueError: when keys are missing or a part does not fit this optimizer.
        """
        load_mixed_precision_state(self, state_dict)
        self._grads_ready = False
        self._record()


def _check_new_params(
    params: list[Any], model_params: list[torch.Tensor], held: list[torch.Tensor], where: str = "param_group"
) -> None:
    """Refuse what torch refuses (a param in two groups), counting a model param with a master as held."""
    ids = [id(p) for p in held]
    for param in params:
        if not torch.is_tensor(param):
            raise TypeError(f"{where}: optimizer params must be tensors, got {type(param).__name__}")
        ids.append(id(param))
    if len(set(ids)) != len(ids):
        raise ValueError(
            f"{where}: some parameters appear in more than one parameter group (or twice in one), "
            "as torch.optim refuses; each parameter may be added once"
        )
    mastered = {id(p) for p in model_params}
    for param in params:
        if id(param) in mastered:
            raise ValueError(
                f"{where}: some parameters appear in more than one parameter group: a model parameter "
                f"of shape {tuple(param.shape)} already has an fp32 master in this optimizer"
            )


def _nothing_scaled(scaler: Any) -> bool:
    """Whether an enabled scaler (mixprec's or torch's) has no scale yet: it is made by the first
    ``scale()``, so gradients reaching a step then did not come from :meth:`MixedPrecisionOptimizer.backward`.
    Other GradScaler-like objects are not asked (their own ``unscale_`` decides)."""
    if isinstance(scaler, GradScaler):
        return scaler.rule.scale is None and scaler.is_enabled()
    if isinstance(scaler, torch.amp.GradScaler):
        return scaler._scale is None and scaler.is_enabled()
    return False


def _guard_for(optimizer: Optimizer, scaler: Any) -> HugeGradientGuard | None:
    """The huge-gradient guard of a wrapper, or None without a scaler (``loss_scale=None``, as torch); a
    wrapper inside says its own (:meth:`~mixprec.optim.wrapper.OptimizerWrapper.scaler_guard`)."""
    enabled = getattr(scaler, "is_enabled", None)
    if callable(enabled) and not enabled():
        return None
    if isinstance(optimizer, OptimizerWrapper):
        return optimizer.scaler_guard()
    return HugeGradientGuard()
