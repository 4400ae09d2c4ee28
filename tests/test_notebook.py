"""The Colab notebook runs top to bottom in a real Jupyter kernel against today's package.

nbclient executes notebooks/colab.ipynb in an ipykernel started from this interpreter, as
Jupyter or `jupyter nbconvert --execute` would: IPython's display, matplotlib's inline hooks and
the cells' own imports are the real ones. The tiny config comes in papermill's way: a cell
tagged `injected-parameters`, inserted after the cell tagged `parameters`, overrides its values.
"""

import ast
import base64
import json
import os
import pathlib
import sys

import pytest
from testing import tiny_overrides

REPO = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "notebooks" / "colab.ipynb"
TIMEOUT_S = 600  # per cell; training the smoke config takes well under a minute


def _code_cells(notebook: dict) -> list[dict]:
  assert notebook["nbformat"] == 4
  cells = [c for c in notebook["cells"] if c["cell_type"] == "code"]
  for cell in cells:
    assert cell["outputs"] == [] and cell["execution_count"] is None, "commit the notebook cleared"
  return cells


def test_every_code_cell_parses_and_one_cell_holds_the_parameters():
  cells = _code_cells(json.loads(NOTEBOOK.read_text()))
  for cell in cells:
    source = "".join(cell["source"])
    ast.parse(source)  # a syntax error names the cell's code
    magic = source.lstrip().startswith(("!", "%"))
    assert not magic, "shell/magic lines would not run outside Colab"
  parameters = [c for c in cells if "parameters" in c["metadata"].get("tags", [])]
  assert len(parameters) == 1
  names = {
      target.id
      for node in ast.parse("".join(parameters[0]["source"])).body
      for target in getattr(node, "targets", [])
  }
  assert names == {"CONFIG", "WORKDIR", "OVERRIDES", "SENTENCE"}


def _with_parameters(notebook, source: str):
  """The notebook with a papermill-style `injected-parameters` cell after the `parameters` one."""
  import nbformat

  cells = notebook.cells
  (index,) = [i for i, c in enumerate(cells) if "parameters" in c.metadata.get("tags", [])]
  injected = nbformat.v4.new_code_cell(source, metadata={"tags": ["injected-parameters"]})
  notebook.cells = cells[: index + 1] + [injected] + cells[index + 1 :]
  return notebook


def _kernel(tmp_path: pathlib.Path):
  """A kernel manager for an ipykernel of this interpreter, importing this checkout's package.

  The spec names `sys.executable` itself, so no kernel registered elsewhere on the machine (or
  in another environment) can stand in for it. One CPU device, as a Colab CPU runtime has.
  """
  from jupyter_client.kernelspec import KernelSpecManager
  from jupyter_client.manager import KernelManager

  xla_flags = " ".join(
      f for f in os.environ.get("XLA_FLAGS", "").split() if "force_host_platform_device" not in f
  )
  spec_dir = tmp_path / "kernels" / "transformer_jax_test"
  spec_dir.mkdir(parents=True)
  (spec_dir / "kernel.json").write_text(
      json.dumps(
          {
              "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
              "display_name": "transformer_jax test",
              "language": "python",
              "env": {"PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags},
          }
      )
  )
  specs = KernelSpecManager(kernel_dirs=[str(tmp_path / "kernels")], ensure_native_kernel=False)
  return KernelManager(kernel_name="transformer_jax_test", kernel_spec_manager=specs)


def _outputs(cell, output_type: str) -> list:
  return [o for o in cell.outputs if o.output_type == output_type]


@pytest.mark.subprocess
def test_the_notebook_trains_plots_translates_and_draws_attention(tmp_path):
  import nbformat
  from nbclient import NotebookClient

  notebook = nbformat.read(NOTEBOOK, as_version=4)
  _code_cells(json.loads(NOTEBOOK.read_text()))
  workdir = tmp_path / "run"
  overrides = tiny_overrides()  # the quickstart shrunk as in the other tests
  _with_parameters(
      notebook,
      (
          f"CONFIG = 'quickstart:smoke'\nWORKDIR = {str(workdir)!r}\n"
          f"OVERRIDES = {overrides!r}\nSENTENCE = ''\n"
      ),
  )
  client = NotebookClient(
      notebook,
      km=_kernel(tmp_path),
      timeout=TIMEOUT_S,
      resources={"metadata": {"path": str(tmp_path)}},  # the kernel's working directory
  )
  client.execute()  # a cell that raises fails the test with its traceback (CellExecutionError)

  code = [c for c in notebook.cells if c.cell_type == "code"]
  assert all(c.execution_count for c in code), "every code cell ran"
  assert not [o for c in code for o in _outputs(c, "error")]
  stdout = "".join(o.text for c in code for o in _outputs(c, "stream") if o.name == "stdout")
  assert f"transformer_jax from {REPO}" in stdout  # this checkout's package, not an installed copy
  assert "1 devices:" in stdout

  results = json.loads((workdir / "results.json").read_text())
  assert results["step"] == 4
  # The training cell ends with the results dict: the kernel shows it as the cell's value.
  (shown,) = [o for c in code for o in _outputs(c, "execute_result")]
  assert "'step': 4" in shown.data["text/plain"]

  assert (workdir / "curves.png").stat().st_size > 10_000
  assert (workdir / "attention.png").stat().st_size > 10_000
  # IPython.display.display(Image(...)) sent both figures to the front end as PNG data.
  shown = [o.data["image/png"] for c in code for o in _outputs(c, "display_data")]
  assert [len(base64.b64decode(png)) for png in shown] == [
      (workdir / "curves.png").stat().st_size,
      (workdir / "attention.png").stat().st_size,
  ]
  assert stdout.count("translated: ") == 5
  assert "source:     " in stdout


@pytest.mark.subprocess
def test_the_notebook_trains_a_parser_and_draws_nltk_trees(shared_data, tmp_path):
  """CONFIG = "parsing_sample", shrunk to a few articles and a tiny model: the same cells train
  it, and section 5 parses test sentences and a plain one into nltk trees."""
  import nbformat
  from nbclient import NotebookClient

  notebook = nbformat.read(NOTEBOOK, as_version=4)
  workdir = tmp_path / "run"
  overrides = {
      "data.path": str(shared_data / "ptb-sample"),
      "data.train_split": "0001-0010",
      "data.eval_split": "0011-0012",
      "data.test_split": "0013-0014",
      "data.max_len": 128,
      "data.num_buckets": 2,
      "model.d_model": 32,
      "model.d_ff": 64,
      "model.num_layers": 1,
      "train.num_steps": 20,
      "train.warmup_steps": 10,
      "train.checkpoint_every": 10,
      "train.eval_every": 10,
      "train.average_last": 2,
      "train.max_train_minutes": 0.0,
      "eval.beam_size": 1,
      "eval.max_decode_extra": 100,
      "eval.num_sentences": 4,
  }
  _with_parameters(
      notebook,
      (
          f"CONFIG = 'parsing_sample'\nWORKDIR = {str(workdir)!r}\n"
          f"OVERRIDES = {overrides!r}\nSENTENCE = ''\n"
      ),
  )
  client = NotebookClient(
      notebook,
      km=_kernel(tmp_path),
      timeout=TIMEOUT_S,
      resources={"metadata": {"path": str(tmp_path)}},
  )
  client.execute()

  code = [c for c in notebook.cells if c.cell_type == "code"]
  assert all(c.execution_count for c in code), "every code cell ran"
  stdout = "".join(o.text for c in code for o in _outputs(c, "stream") if o.name == "stdout")
  assert "test_f1" in json.loads((workdir / "results.json").read_text())
  # Three trees drawn by nltk's pretty_print (TOP at the top of each); the plain sentence's words
  # as the Treebank tokenizer splits them.
  assert stdout.count("TOP") >= 3
  for word in ("company", "'s", "-LRB-", "$", "3.50", "-RRB-"):
    assert word in stdout, word
  assert (workdir / "attention.png").stat().st_size > 10_000
