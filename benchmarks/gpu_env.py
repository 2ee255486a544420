"""What this machine has for benchmarks/gpu.sh: device, versions, and which optional packages import.

Prints one line per fact and writes them to ``--json``: the device (name, compute capability, memory),
torch, CUDA, cuDNN, Python and mixprec versions, and for each optional package gpu.sh's steps may use
(matplotlib, scikit-learn, torch-optimi, torchao, transformers, lightning, pytest) whether it imports
(its version, or the error). gpu.sh reads ``packages`` to skip, with the reason, a step whose package
is missing instead of letting it fail. ``--missing [NAMES]`` prints only the import names that fail (of
NAMES, comma-separated, default all), on one line, without importing torch for the device facts.

Usage::

    python benchmarks/gpu_env.py --json env.json
    python benchmarks/gpu_env.py --missing matplotlib,sklearn
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import sys
from typing import Any

# import name -> what people install (pip name), in the order the table lists them.
OPTIONAL = {
    "matplotlib": "matplotlib",
    "sklearn": "scikit-learn",
    "optimi": "torch-optimi",
    "torchao": "torchao",
    "transformers": "transformers",
    "lightning": "lightning",
    "pytest": "pytest",
}


def packages(names: dict[str, str] = OPTIONAL) -> dict[str, dict[str, Any]]:
    """Import name -> ``{"package", "ok", "version" or "error"}``, each found by importing it here."""
    found = {}
    for name, package in names.items():
        try:
            module = importlib.import_module(name)
        except Exception as exc:  # a broken install (wrong torch ABI) counts as missing, with its error
            found[name] = {"package": package, "ok": False, "error": f"{type(exc).__name__}: {exc}"}
        else:
            found[name] = {"package": package, "ok": True, "version": getattr(module, "__version__", None)}
    return found


def device_facts() -> dict[str, Any]:
    """The CUDA device (or None), its capability and memory, and the versions of torch and friends."""
    import torch

    import mixprec

    facts: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "mixprec": getattr(mixprec, "__version__", None),
        "mixprec_path": mixprec.__file__,
        "device": None,
        "capability": None,
        "memory_gib": None,
        "device_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        facts.update(device=props.name, capability=f"{props.major}.{props.minor}")
        facts["memory_gib"] = round(props.total_memory / 2**30, 1)
    return facts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the facts here")
    parser.add_argument(
        "--missing", nargs="?", const=",".join(OPTIONAL), metavar="NAMES", help="print the imports that fail"
    )
    args = parser.parse_args(argv)
    if args.missing is not None:
        names = [n for n in args.missing.split(",") if n]
        unknown = sorted(set(names) - set(OPTIONAL))
        if unknown:
            parser.error(f"--missing: unknown names {unknown}; accepted: {list(OPTIONAL)}")
        found = packages({n: OPTIONAL[n] for n in names})
        print(" ".join(name for name, entry in found.items() if not entry["ok"]))
        return 0
    found = packages()
    facts = {**device_facts(), "packages": found}
    for key, value in facts.items():
        if key != "packages":
            print(f"{key:14} {value}")
    for entry in found.values():
        state = f"ok {entry['version'] or ''}".rstrip() if entry["ok"] else f"MISSING ({entry['error']})"
        print(f"{entry['package']:14} {state}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(facts, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
