"""The tree passes ruff on the rules in pyproject.toml ([tool.ruff.lint]: bugs such as undefined names and unused
imports, not style), notebooks included. `python -m ruff check .` says the same; `--fix` mends the unused imports."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytest.importorskip("ruff", reason="ruff is not installed (pip install -e '.[test]')")


def test_the_tree_passes_ruff():
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
