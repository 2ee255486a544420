"""The parts of GradScaler that speak torch's language: its getter/setter pairs and its checkpoint format."""

from __future__ import annotations

from typing import Any

from mixprec.scaling.dynamic import DynamicScale
from mixprec.scaling.monitor import SkipMonitor
from mixprec.scaling.rules import ScaleRule
from mixprec.scaling.state import GradScalerError, OptimizerRecord

__all__ = ["TorchAccessors"]


class TorchAccessors:
    """``get_/set_growth_factor``, ``backoff_factor``, ``growth_interval`` (validated by the rule), and
    ``state_dict``/``load_state_dict`` with torch's keys, so checkpoints move both ways.

    Raises:
        TypeError: when the scaler's rule has no such setting (StaticScale, NoScale).
        ValueError: for a value the rule refuses.
    """

    rule: ScaleRule
    monitor: SkipMonitor
    _enabled: bool
    _records: dict[int, OptimizerRecord]

    def _dynamic(self, name: str) -> DynamicScale:
        if not isinstance(self.rule, DynamicScale):
            rule = self.rule.name
            raise TypeError(f"{name} belongs to DynamicScale and HeadroomScale; this scaler's rule is {rule}")
        return self.rule

    def get_growth_factor(self) -> float:
        """The growth factor of the dynamic rule."""
        return self._dynamic("growth_factor").growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        """Set the growth factor (> 1)."""
        self._dynamic("growth_factor").growth_factor = new_factor

    def get_backoff_factor(self) -> float:
        """The backoff factor of the dynamic rule."""
        return self._dynamic("backoff_factor").backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the backoff factor (in (0, 1))."""
        self._dynamic("backoff_factor").backoff_factor = new_factor

    def get_growth_interval(self) -> int:
        """The growth interval of the dynamic rule."""
        return self._dynamic("growth_interval").growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        """Set the growth interval (>= 1)."""
        self._dynamic("growth_interval").growth_interval = new_interval

    def state_dict(self) -> dict[str, Any]:
        """Torch's keys (``scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval``,
        ``_growth_tracker``) plus mixprec's; empty when disabled. Call it after :meth:`update`."""
        if not self._enabled:
            return {}
        return {**self.rule.state_dict(), **self.monitor.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict` or from a torch GradScaler's; a no-op when disabled.

        Every key is checked before anything changes (see :meth:`validate_state_dict`): a dict that raises
        leaves the scaler exactly as it was.

        Raises:
            RuntimeError: for an empty dict (saved from a disabled scaler).
            TypeError: when ``state_dict`` is not a dict.
            ValueError: for a missing or bad key (named), or a dict saved from a different kind of rule.
        """
        if not self._enabled:
            return
        rule_values, monitor_values = self._read_state(state_dict)
        self.rule._apply_state(rule_values)
        self.monitor._apply_state(monitor_values)

    def validate_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Raise what :meth:`load_state_dict` would raise for ``state_dict``, changing nothing.

        For wrappers that restore several parts at once (a model, an optimizer, this scaler): check every
        part first, then load them all.
        """
        if self._enabled:
            self._read_state(state_dict)

    def _read_state(self, state_dict: dict[str, Any]) -> tuple[dict[str, Any], dict[str, int]]:
        if not isinstance(state_dict, dict):
            raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}: {state_dict!r:.80}")
        if len(state_dict) == 0:
            raise RuntimeError(
                "The source state dict is empty, possibly because it was saved from a disabled instance of "
                "GradScaler."
            )
        return self.rule.read_state(state_dict), self.monitor.read_state(state_dict)

    def __getstate__(self) -> dict[str, Any]:
        if self._records:
            raise GradScalerError(
                "A GradScaler instance may only be pickled at the beginning of an iteration, or at the end "
                "after scaler.update()."
            )
        return self.__dict__.copy()
