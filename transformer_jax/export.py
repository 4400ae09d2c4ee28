"""Export a trained run to CTranslate2, a C++ inference engine for Transformer translation models.

  python -m transformer_jax.export --workdir DIR --format ctranslate2 --output OUT
      [--checkpoint auto|latest|avg|STEP]
      [--quantization float32|int8|int8_float32|float16|bfloat16]

OUT is a CTranslate2 model directory (`model.bin`, `shared_vocabulary.json`, `config.json` and, for
a SentencePiece run, `sentencepiece.model`); what is written and how it is checked:
serving/ctranslate2_model.py and docs/export.md.
"""

from __future__ import annotations

import logging

from absl import flags

from transformer_jax import cli
from transformer_jax.serving.ctranslate2_model import FORMATS, QUANTIZATIONS, export_run


def _define_flags():
  # Defined only when run as a program, so importing this module defines no flags.
  flags.DEFINE_string("workdir", None, "The training run's --workdir.")
  flags.DEFINE_string(
      "checkpoint",
      "auto",
      "A step number, 'latest', 'avg', or 'auto' (what the run's final evaluation used).",
  )
  flags.DEFINE_string("format", "ctranslate2", f"Export format: {', '.join(FORMATS)}.")
  flags.DEFINE_string("output", None, "The model directory to write (must not exist).")
  flags.DEFINE_string(
      "quantization", "float32", f"Weight type in the exported model: {', '.join(QUANTIZATIONS)}."
  )


def main(argv):
  args = cli.workdir_args(argv)
  info = export_run(args.workdir, args.output, args.checkpoint, args.quantization, args.format)
  logging.info("exported %s of %s to %s (%s)", info["checkpoint"], args.workdir, args.output,
               args.quantization)  # fmt: skip
  return 0


if __name__ == "__main__":
  _define_flags()
  cli.run(main)
