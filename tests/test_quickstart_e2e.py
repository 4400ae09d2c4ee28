"""End to end: the README's main command trains the quickstart model to BLEU > 90 (~6 min, slow).

Run with `python -m pytest -m slow`; .ci/run runs it after the default suite.
"""

import json
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_quickstart_learns_the_synthetic_task(tmp_path):
  proc = subprocess.run(
      [sys.executable, "train.py", "--config", "configs/quickstart.py", "--workdir", str(tmp_path)],
      cwd=REPO, capture_output=True, text=True, timeout=1800,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  results = json.loads((tmp_path / "results.json").read_text())
  assert results["step"] == 600
  assert results["test_bleu"] > 90.0, results
