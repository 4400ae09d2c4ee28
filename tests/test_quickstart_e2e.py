"""End to end: the README's main command trains the quickstart model to BLEU > 90 (~4 min, slow).

Run with `python -m pytest -m slow`; .ci/run runs it after the default suite.

The command runs as a user runs it on a fresh machine: without conftest's 8 fake CPU devices
(the other tests cover sharding). With 8 fake devices on a loaded 2-core CI machine, XLA aborted
this run once in a CPU all-reduce whose rendezvous timed out ("only 5 of them arrived on time").
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_quickstart_learns_the_synthetic_task(tmp_path):
  env = dict(os.environ)
  flags = [
      f
      for f in env.get("XLA_FLAGS", "").split()
      if not f.startswith("--xla_force_host_platform_device_count")
  ]
  env["XLA_FLAGS"] = " ".join(flags)
  proc = subprocess.run(
      [sys.executable, "train.py", "--config", "configs/quickstart.py", "--workdir", str(tmp_path)],
      cwd=REPO,
      capture_output=True,
      text=True,
      timeout=1800,
      env=env,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  results = json.loads((tmp_path / "results.json").read_text())
  assert results["step"] == 600
  assert results["test_bleu"] > 90.0, results
