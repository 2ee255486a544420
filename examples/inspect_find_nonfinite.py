"""Find where a float16 run first goes non-finite, pin that module to float32, and check again.

python examples/inspect_find_nonfinite.py
"""

import torch

from mixprec.autocast import autocast
from mixprec.inspect import demo, find_nonfinite, trace_dtypes
from mixprec.policy import Policy


def main() -> None:
    model, inputs = demo.backward_overflow_model(), demo.demo_inputs()
    loss_fn = demo.scaled_loss(2.0**12)  # the loss times a loss scale of 2^12

    report = find_nonfinite(model, inputs, loss_fn=loss_fn)
    print(report)

    # Run the culprit (and, since its gradient must also leave it, the block before it) in float32.
    policy = Policy.for_device("cpu", torch.float16).with_modules(
        {report.module: torch.float32, "blocks.0": torch.float32}
    )
    print(
        "pinned:", find_nonfinite(model, inputs, loss_fn=loss_fn, policy=policy) or "every value stays finite"
    )

    with trace_dtypes(model) as trace, autocast("cpu", policy=policy):
        model(inputs)
    print(trace.table())


if __name__ == "__main__":
    main()
