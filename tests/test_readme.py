"""The README's example runs as written, and its first screen holds what a newcomer needs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def first_python_block(text: str) -> str:
    match = re.search(r"```python\n(.*?)```", text, re.S)
    assert match, "README.md has no python block"
    return match.group(1)


def test_the_first_screen_holds_the_commands_the_pitch_and_the_example() -> None:
    lines = README.read_text().splitlines()
    assert lines[2].split("#")[0].strip() == "make demo" and lines[3].split("#")[0].strip() == "make test"
    assert "```python" in lines[:40]
    assert len(lines) <= 150
    assert len(first_python_block(README.read_text()).splitlines()) <= 30


@pytest.mark.timeout(300)
def test_the_readme_example_runs_as_written(tmp_path: Path) -> None:
    script = tmp_path / "readme_example.py"
    script.write_text(first_python_block(README.read_text()))
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    # its own interpreter, so torchrl's default start method (spawn) re-imports it as a user's script
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "difficulty range reached:" in done.stdout
