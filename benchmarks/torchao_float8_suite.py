"""torchao's own float8 test suite, run on torchao and with mixprec.float8 substituted for its public API.

Takes torchao's ``test/float8`` sources at the tag of the installed torchao (from a git directory, e.g. the
one ``fetch github:pytorch/ao`` leaves, or a folder holding them), writes them to a scratch folder (never
into this repository), and runs them twice with pytest:

* ``torchao``: as they are;
* ``mixprec``: a ``conftest.py`` points torchao's ``Float8LinearConfig``, ``Float8Linear`` and
  ``convert_to_float8_training`` (in every torchao module the tests import them from) at mixprec's. The
  tests' other calls (``hp_tensor_to_float8_dynamic``, ``compute_error``, ``Float8TrainingTensor``, their
  ``CastConfig`` / ``ScalingType`` objects) stay torchao's: they are the oracle mixprec is measured by.

A test counts as one *of the public API* when, in that run, it constructed a config or a module or called
the conversion (the conftest records it). With ``--force-cpu`` a second copy of the sources is also run
where ``torch.accelerator.is_available()`` reads True and ``current_accelerator()`` the CPU, so the tests
torchao gates on a GPU run on the CPU; some then fail on torchao itself (kernels a CPU lacks), and those
failures are reported as such. That copy names fp16 where a test relies on autocast's CUDA default dtype
(the CPU's is bf16), and runs ``test_numerics_integration``'s LLaMA-3-70B feed-forward block 16 times
smaller in every dimension (:data:`SHRINK`). ``expecttest`` (imported by torchao's tests) is replaced by a
six-line stand-in when it is not installed.

Usage::

    python benchmarks/torchao_float8_suite.py --ao-git-dir /work/.mirror/pytorch+ao/repo --force-cpu \\
        --json /tmp/torchao_float8_suite.json
    python benchmarks/torchao_float8_suite.py --ao-tests /path/to/ao/test/float8 --files test_base.py
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
# The files of test/float8 that run on one process (FSDP / DTensor ones need several GPUs).
FILES = ("test_base.py", "test_compile.py", "test_numerics_integration.py", "test_auto_filter.py")
FILES += ("test_float8_utils.py",)
MODES = ("torchao", "mixprec")

CONFTEST = """# Written by mixprec's benchmarks/torchao_float8_suite.py: MIXPREC_AO_SHIM=mixprec points
# torchao's public float8 module/config API at mixprec.float8's; each run records the tests using it.
import functools, json, os
import torchao.float8 as tf
import torchao.float8.config as tcfg
import torchao.float8.float8_linear as tlin
import torchao.float8.float8_linear_utils as tutils
import torchao.testing.training.test_utils as ttu

USED, CURRENT = set(), [None]

def _logged(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        USED.add(CURRENT[0])
        return fn(*args, **kwargs)
    return wrapper

if os.environ["MIXPREC_AO_SHIM"] == "mixprec":
    import mixprec.float8 as mf
    config_cls, linear_cls, convert = mf.Float8Config, mf.Float8Linear, mf.convert_to_float8_training
    for mod in (tf, tcfg, ttu, tutils, tlin):
        if hasattr(mod, "Float8LinearConfig"):
            mod.Float8LinearConfig = config_cls
    for mod in (tf, tlin, tutils):
        if hasattr(mod, "Float8Linear"):
            mod.Float8Linear = linear_cls
else:
    config_cls, linear_cls = tcfg.Float8LinearConfig, tlin.Float8Linear
    convert = tutils.convert_to_float8_training
config_cls.__post_init__ = _logged(config_cls.__post_init__)
linear_cls.__init__ = _logged(linear_cls.__init__)
for mod in (tf, tutils):
    mod.convert_to_float8_training = _logged(convert)

def pytest_runtest_setup(item):
    CURRENT[0] = item.nodeid

def pytest_sessionfinish(session):
    with open(os.environ["MIXPREC_AO_API_LOG"], "w") as f:
        json.dump(sorted(u for u in USED if u), f)
"""
EXPECTTEST = """# stand-in for `expecttest`, written by mixprec's benchmarks/torchao_float8_suite.py
import unittest
ACCEPT = False
class TestCase(unittest.TestCase):
    def assertExpectedInline(self, actual, expect, skip=0):
        self.assertEqual(actual.strip(), expect.strip())
"""


# test_numerics_integration trains a LLaMA-3-70B feed-forward block (4096 -> 22528 -> 4096, 8192 tokens):
# hours per test on a shared CPU. The CPU copy runs it 16 times smaller in every dimension.
SHRINK = {
    "dim=4096,": "dim=256,",
    "hidden_dim=16384,": "hidden_dim=1024,",
    "multiple_of=1024,": "multiple_of=64,",
    "shape = (1, 8192, 4096)": "shape = (1, 512, 256)",
}


def force_cpu(text: str, file: str) -> str:
    """The test source with the GPU gates opened on the CPU (and the integration shapes shrunk)."""
    text = text.replace("torch.accelerator.is_available()", "True")
    text = text.replace("torch.accelerator.current_accelerator()", 'torch.device("cpu")')
    # torch.autocast's default dtype is fp16 on CUDA (what test_autocast_outputs asserts), bf16 on a CPU.
    text = text.replace(
        "with torch.autocast(str(device)):", "with torch.autocast(str(device), dtype=torch.half):"
    )
    if file == "test_numerics_integration.py":
        for old, new in SHRINK.items():
            if old not in text:
                raise SystemExit(f"{file} no longer holds {old!r}: update SHRINK for this torchao")
            text = text.replace(old, new)
    return text


def write_sources(args: argparse.Namespace, root: Path) -> dict[str, Path]:
    """The variants' folders (``plain``, and ``cpu`` with --force-cpu), each with the tests and conftest."""
    variants = {"plain": root / "plain"} | ({"cpu": root / "cpu"} if args.force_cpu else {})
    for name, folder in variants.items():
        folder.mkdir(parents=True)
        (folder / "conftest.py").write_text(CONFTEST)
        for file in args.files:
            if args.ao_tests:
                text = (Path(args.ao_tests) / file).read_text()
            else:
                show = ["git", "--git-dir", args.ao_git_dir, "show", f"{args.ref}:test/float8/{file}"]
                text = subprocess.run(show, check=True, capture_output=True, text=True).stdout
            (folder / file).write_text(force_cpu(text, file) if name == "cpu" else text)
    return variants


def run_pytest(folder: Path, mode: str, root: Path, stubs: Path | None) -> dict[str, dict[str, str]]:
    """``{file: {test: outcome}}`` of one pytest run; outcomes passed / failed / skipped (+ message)."""
    xml, log = root / f"{folder.name}-{mode}.xml", root / f"{folder.name}-{mode}.api.json"
    paths = [str(SRC)] + ([str(stubs)] if stubs else []) + [os.environ.get("PYTHONPATH", "")]
    env = os.environ | {"MIXPREC_AO_SHIM": mode, "MIXPREC_AO_API_LOG": str(log), "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", str(folder)]
    subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True)
    api = set(json.loads(log.read_text())) if log.exists() else set()
    results: dict[str, dict[str, str]] = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        module, *classes = case.get("classname", "").split(".")
        test = "::".join([*classes, case.get("name", "")])
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed: " + (child.get("message") or "").split("\n")[0][:200]
            elif child.tag == "skipped":
                outcome = "skipped"
        api_tag = " [api]" if f"{module}.py::{test}" in api else ""
        results.setdefault(f"{module}.py", {})[test] = outcome + api_tag
    return results


def summarize(torchao: dict, mixprec: dict) -> dict[str, object]:
    """Counts per file and the tests that pass on torchao but not with mixprec."""
    rows, regressions = {}, []
    for file in sorted(set(torchao) | set(mixprec)):
        t, m = torchao.get(file, {}), mixprec.get(file, {})
        api = [n for n in set(t) | set(m) if "[api]" in t.get(n, "") + m.get(n, "")]
        rows[file] = {
            "collected": len(set(t) | set(m)),
            "torchao_passed": sum(v.startswith("passed") for v in t.values()),
            "mixprec_passed": sum(v.startswith("passed") for v in m.values()),
            "api_tests": len(api),
            "api_torchao_passed": sum(t.get(n, "").startswith("passed") for n in api),
            "api_mixprec_passed": sum(m.get(n, "").startswith("passed") for n in api),
            "skipped": sum(v.startswith("skipped") for v in t.values()),
        }
        for n in sorted(set(t) | set(m)):
            if t.get(n, "").startswith("passed") and not m.get(n, "").startswith("passed"):
                regressions.append({"file": file, "test": n, "mixprec": m.get(n, "absent")})
    both = [
        {"file": f, "test": n, "torchao": v}
        for f in torchao
        for n, v in torchao[f].items()
        if v.startswith("failed") and not mixprec.get(f, {}).get(n, "").startswith("passed")
    ]
    return {"files": rows, "torchao_only_passes": regressions, "failing_on_torchao": both}


def print_table(variant: str, summary: dict) -> None:
    print(f"\n{variant}: file, collected, skipped, passed on torchao / mixprec, API tests: passed on each")
    for file, r in summary["files"].items():
        print(
            f"  {file:30s} {r['collected']:4d} {r['skipped']:4d}   {r['torchao_passed']:4d} /"
            f" {r['mixprec_passed']:4d}   {r['api_tests']:3d}: {r['api_torchao_passed']:3d} /"
            f" {r['api_mixprec_passed']:3d}"
        )
    for reg in summary["torchao_only_passes"]:
        print(f"  passes on torchao only: {reg['file']}::{reg['test']}: {reg['mixprec'][:140]}")
    print(f"  failing on torchao itself: {len(summary['failing_on_torchao'])}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--ao-git-dir", help="a git directory of pytorch/ao holding the --ref tag")
    where.add_argument("--ao-tests", help="a folder holding torchao's test/float8 files")
    parser.add_argument("--ref", default=None, help="tag to read (default: v<installed torchao version>)")
    parser.add_argument("--files", nargs="+", default=list(FILES))
    parser.add_argument("--force-cpu", action="store_true", help="also run the GPU-gated tests on the CPU")
    parser.add_argument("--json", help="write the per-test outcomes and counts here")
    args = parser.parse_args(argv)
    import torchao  # the suite needs the installed torchao, so it is imported only when run

    args.ref = args.ref or f"v{torchao.__version__.split('+')[0]}"
    root = Path(tempfile.mkdtemp(prefix="torchao_float8_suite_"))
    stubs = None
    if subprocess.run([sys.executable, "-c", "import expecttest"], capture_output=True).returncode:
        stubs = root / "stubs"
        stubs.mkdir()
        (stubs / "expecttest.py").write_text(EXPECTTEST)
    report = {"torchao": torchao.__version__, "ref": args.ref, "files": args.files, "variants": {}}
    for variant, folder in write_sources(args, root).items():
        start = time.perf_counter()
        with ThreadPoolExecutor(len(MODES)) as pool:  # both runs at once: half the wall time
            runs = {mode: pool.submit(run_pytest, folder, mode, root, stubs) for mode in MODES}
        outcomes = {mode: run.result() for mode, run in runs.items()}
        summary = summarize(outcomes["torchao"], outcomes["mixprec"])
        summary["seconds"] = round(time.perf_counter() - start, 1)
        report["variants"][variant] = {"summary": summary, "outcomes": outcomes}
        print_table(variant, summary)
    print(f"\ntorchao {torchao.__version__}, tests from {args.ref}; scratch folder {root}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
