"""README.md stays a README: at most 300 lines, its first set-up command installs and runs the
main job, and its test command is byte for byte the one `.ci/run` runs."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_set_up_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    blocks = re.findall(r"```bash\n(.*?)\n```", readme, re.S)
    assert blocks[0].startswith("pip install torch==2.13.0 -e . && dyntree generate ")
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert blocks[1] == ci[-1]  # the README's test command is what CI runs
