"""The README's two set-up commands are the ones CI runs and the main job exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def setup_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Set up", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "no bash block under '## Set up'"
    return [line for line in block.group(1).splitlines() if line.strip() and not line.startswith("#")]


def test_exactly_two_setup_commands_main_job_and_tests() -> None:
    main_job, tests = setup_commands()
    assert main_job.endswith("&& mixprec bench")
    assert tests.endswith("&& python -m pytest")


def test_ci_runs_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    install, command = setup_commands()[1].split(" && ")
    assert f"# {install} && {command}" in ci  # the command, quoted verbatim
    assert re.search(rf"^{re.escape(install.replace('pip install', 'pip install -q'))}$", ci, re.M)
    assert re.search(rf"^{re.escape(command)}$", ci, re.M)
    main_install = setup_commands()[0].split(" && ")[0]
    assert "torch==" in main_install and "torch==" in install


def test_the_loop_sketch_points_to_its_runnable_version_and_the_fake_cuda_tier_is_said_plainly() -> None:
    text = (ROOT / "README.md").read_text()
    loop = text.split("## A mixed-precision loop", 1)[1].split("```python", 1)[0]
    assert "make_model" in loop and "docs/guide/first-loop.md) is the runnable version" in loop
    assert "The fake-CUDA tier runs on the CPU with torch's CUDA\nbuild" in text and "no GPU needed" in text
