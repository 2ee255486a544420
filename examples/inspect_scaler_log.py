"""Log a loss scaler while training in float16, then turn the log into pictures and a summary.

python examples/inspect_scaler_log.py [OUT_DIR]
"""

import sys
from pathlib import Path

import torch

from mixprec.autocast import autocast
from mixprec.inspect import ScalerLog, demo, underflow_report, write_report


def main(out: Path) -> None:
    model = demo.healthy_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=5)  # or mixprec's GradScaler
    generator = torch.Generator().manual_seed(0)
    with ScalerLog(scaler, out / "run.jsonl", optimizer=optimizer, model=model, histogram_every=5) as log:
        for step in range(20):
            x = torch.randn(16, demo.WIDTH, generator=generator)
            with autocast("cpu", dtype=torch.float16):
                loss = (model(x).float() - x[:, :1]).square().mean()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            log.record(step, loss=loss)
            optimizer.zero_grad()
    print(f"skipped steps: {log.skipped_steps}")

    report = underflow_report(
        model, x, loss_fn=lambda m, b: (m(b) - b[:, :1]).square().mean(), scale=scaler.get_scale()
    )
    print(report)
    for path in write_report(out / "run.jsonl", out / "report"):
        print(f"wrote {path}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("inspect_example"))
