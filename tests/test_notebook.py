"""The Colab notebook runs top to bottom against today's package, with a tiny config."""

import ast
import json
import os
import pathlib
import subprocess
import sys

from testing import tiny_overrides

REPO = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "notebooks" / "colab.ipynb"

# Outside Jupyter, IPython may be missing: its display functions become prints.
IPYTHON_STUB = """
try:
  import IPython.display
except ImportError:
  import types
  _display = types.ModuleType("IPython.display")
  _display.Image = lambda path: f"<image {path}>"
  _display.display = print
  _ipython = types.ModuleType("IPython")
  _ipython.display = _display
  sys.modules.update({"IPython": _ipython, "IPython.display": _display})
"""


def _code_cells():
  notebook = json.loads(NOTEBOOK.read_text())
  assert notebook["nbformat"] == 4
  cells = [c for c in notebook["cells"] if c["cell_type"] == "code"]
  for cell in cells:
    assert cell["outputs"] == [] and cell["execution_count"] is None, "commit the notebook cleared"
  return cells


def test_every_code_cell_parses_and_one_cell_holds_the_parameters():
  cells = _code_cells()
  for cell in cells:
    source = "".join(cell["source"])
    ast.parse(source)  # a syntax error names the cell's code
    shell_or_magic = source.lstrip().startswith(("!", "%"))
    assert not shell_or_magic, "shell/magic lines would not run outside Colab"
  parameters = [c for c in cells if "parameters" in c["metadata"].get("tags", [])]
  assert len(parameters) == 1
  names = {
      target.id
      for node in ast.parse("".join(parameters[0]["source"])).body
      for target in getattr(node, "targets", [])
  }
  assert names == {"CONFIG", "WORKDIR", "OVERRIDES", "SENTENCE"}


def test_the_notebook_trains_plots_translates_and_draws_attention(tmp_path):
  overrides = tiny_overrides()  # the quickstart shrunk as in the other tests
  workdir = tmp_path / "run"
  parameters = (
      f"CONFIG = 'quickstart:smoke'\nWORKDIR = {str(workdir)!r}\n"
      f"OVERRIDES = {overrides!r}\nSENTENCE = ''\n"
  )
  sources = []
  for cell in _code_cells():
    tags = cell["metadata"].get("tags", [])
    sources.append(parameters if "parameters" in tags else "".join(cell["source"]))
  script = tmp_path / "notebook.py"
  script.write_text("import sys\n" + IPYTHON_STUB + "\n\n".join(sources) + "\n")
  env = {**os.environ, "PYTHONPATH": str(REPO)}
  fake_devices = "--xla_force_host_platform_device_count=8"
  env["XLA_FLAGS"] = env.get("XLA_FLAGS", "").replace(fake_devices, "")
  proc = subprocess.run(
      [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
      timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  results = json.loads((workdir / "results.json").read_text())
  assert results["step"] == 4
  assert (workdir / "curves.png").stat().st_size > 10_000
  assert (workdir / "attention.png").stat().st_size > 10_000
  assert proc.stdout.count("translated: ") == 5
  assert "source:     " in proc.stdout
