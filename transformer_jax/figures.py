"""Figures written to files: matplotlib without a display, and an output name checked first."""

from __future__ import annotations

import os

from transformer_jax.errors import UserError


def pyplot():
  """matplotlib.pyplot drawing to files (no display needed), or an error saying what to install."""
  try:
    import matplotlib
  except ImportError:
    raise ImportError("plotting needs matplotlib: pip install -e '.[plots]'") from None
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  return plt


def check_output(output: str) -> None:
  """A figure file matplotlib can write at `output`, or a UserError naming --output."""
  pyplot()  # matplotlib, or the error saying what to install
  from matplotlib.backend_bases import FigureCanvasBase

  directory = os.path.dirname(output) or "."
  extension = os.path.splitext(output)[1].lstrip(".").lower()
  formats = FigureCanvasBase.get_supported_filetypes()
  if os.path.isdir(output):
    raise UserError(f"--output {output} is a directory; give a file name such as curves.png")
  if not os.path.isdir(directory):
    raise UserError(f"--output {output}: the directory {directory} does not exist")
  if extension not in formats:
    raise UserError(f"--output {output}: expected a name ending in .{', .'.join(formats)}")
