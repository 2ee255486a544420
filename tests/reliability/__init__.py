"""The bad-input battery (issue 11): every public argument, state dict and call order, judged."""
