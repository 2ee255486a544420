"""The op policy: which ops run in low precision, which in fp32, which in the widest input type."""

from mixprec.policy.policy import DEFAULT_DTYPES, PASSTHROUGH, POLICY_PRESETS, Policy, ResolvedPolicy

__all__ = ["DEFAULT_DTYPES", "PASSTHROUGH", "POLICY_PRESETS", "Policy", "ResolvedPolicy"]
