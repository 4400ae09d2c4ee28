"""Translate with a trained run: one line in, one line out, in order.

  python -m transformer_jax.translate --workdir DIR [--checkpoint auto|STEP|latest|avg]
      [--beam_size 4] [--alpha 0.6] < input.txt > output.txt
  python -m transformer_jax.translate --workdir DIR --input in.txt --output out.txt

Sentences are grouped by length internally (few compiled shapes, little padding) and written back
in input order. An empty line gives an empty line; a line longer than the run's maximum length is
truncated with a warning naming the line.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys

import jax
import ml_collections
from absl import app, flags

from transformer_jax import checkpoint, cli, xla_flags
from transformer_jax import config as config_lib
from transformer_jax.data import pipeline
from transformer_jax.data.tokenizer import Tokenizer


@dataclasses.dataclass
class LoadedRun:
  config: ml_collections.ConfigDict
  tokenizer: Tokenizer
  trainer: object  # transformer_jax.train.Trainer
  params: object
  checkpoint: str  # which parameters: "step N" or "average of steps [...]"


def load_trainer(workdir: str, beam_size=None, alpha=None):
  """(config, tokenizer, Trainer) of the run in `workdir`, laid out on this machine's devices."""
  from transformer_jax import train  # heavy; keeps `--help` fast

  config_path = os.path.join(workdir, "config.json")
  if not os.path.exists(config_path):
    raise FileNotFoundError(f"{workdir} has no config.json: is it the --workdir of a training run?")
  with open(config_path) as f:
    saved = json.load(f)
  # On top of today's defaults, older key layouts mapped, so a run saved before a change loads.
  config = config_lib.from_saved(saved)
  config.mesh = ml_collections.ConfigDict({"data": -1, "fsdp": 1, "tensor": 1})
  if beam_size is not None:
    config.eval.beam_size = beam_size
  if alpha is not None:
    config.eval.alpha = alpha
  config_lib.validate(config)
  xla_flags.apply(config.xla_flags)  # no-op once JAX has started (e.g. after training in-process)
  tokenizer = pipeline.load_workdir_tokenizer(workdir)
  model_config = config_lib.model_config(config, tokenizer.vocab_size)
  return config, tokenizer, train.Trainer(config, model_config)


def averaged_steps(workdir: str) -> list[int] | None:
  """The steps `workdir`'s averaged checkpoint (§6.1) was made from, or None if it has none."""
  path = os.path.join(workdir, checkpoint.AVERAGED_DIR, "steps.json")
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)["steps"]


def load_run(workdir: str, which: str = "auto", beam_size=None, alpha=None) -> LoadedRun:
  """Config, vocabulary and parameters of the training run in `workdir`.

  `which`: "latest", a step number, "avg" (the averaged checkpoint, §6.1), or "auto": what the
  run's final evaluation used, i.e. the average when the run averages (train.average_last) and
  the average includes the latest checkpoint, else the latest checkpoint.
  """
  if which not in ("auto", "latest", "avg") and not which.isdigit():
    raise ValueError(f"--checkpoint={which!r}: expected a step number, 'latest', 'avg' or 'auto'")
  config, tokenizer, trainer = load_trainer(workdir, beam_size, alpha)
  abstract = trainer.abstract_state()
  with checkpoint.make_manager(workdir, keep=1, save_every=1) as manager:
    steps = manager.all_steps()
    if which == "auto":
      averaged = averaged_steps(workdir)
      current = bool(averaged) and bool(steps) and max(averaged) == max(steps)
      which = "avg" if config.train.average_last and current else "latest"
    if which == "avg":
      params = checkpoint.load_averaged(workdir, abstract.params)
      label = f"average of steps {averaged_steps(workdir)}"
    else:
      if not steps:
        raise FileNotFoundError(
            f"{workdir} has no checkpoint yet (checkpoints/ is empty): train first, or pass the "
            "--workdir of a run that has saved one"
        )
      step = max(steps) if which == "latest" else int(which)
      if step not in steps:
        raise ValueError(f"--checkpoint={which}: {workdir} holds steps {sorted(steps)}")
      params = checkpoint.restore(manager, abstract, step)[0].params
      label = f"step {step}"
  return LoadedRun(config, tokenizer, trainer, params, label)


def translate_lines(run: LoadedRun, lines: list[str]) -> list[str]:
  """Translates each line; empty lines stay empty; over-long lines are truncated with a warning."""
  limit = run.config.data.max_len - 1  # room for EOS
  examples, where = [], []
  for number, line in enumerate(lines, start=1):
    text = line.strip()
    if not text:
      continue
    ids = run.tokenizer.encode(text)
    if len(ids) > limit:
      logging.warning(
          "line %d has %d tokens; the model was trained on at most %d: translating its first %d",
          number, len(ids), limit, limit,
      )
      ids = ids[:limit]
    examples.append((ids, []))
    where.append(number - 1)
  out = [""] * len(lines)
  if examples:
    buckets = pipeline.eval_bucket_lengths(run.config.data)
    for i, hyp in zip(where, run.trainer.translate(run.params, examples, buckets, run.tokenizer)):
      out[i] = hyp
  return out


def _define_flags():
  # Defined only when run as a program, so importing this module defines no flags.
  flags.DEFINE_string("workdir", None, "The training run's --workdir.")
  flags.DEFINE_string(
      "checkpoint", "auto", "A step number, 'latest', 'avg', or 'auto' (what the run's final "
      "evaluation used: the average when train.average_last is set, else the latest)."
  )
  flags.DEFINE_integer("beam_size", None, "Beam size (1 = greedy); default: the run's.")
  flags.DEFINE_float("alpha", None, "Length penalty α; default: the run's.")
  flags.DEFINE_string("input", None, "Input file (default: standard input).")
  flags.DEFINE_string("output", None, "Output file (default: standard output).")


def main(argv):
  args = cli.workdir_args(argv)
  try:
    run = load_run(args.workdir, args.checkpoint, args.beam_size, args.alpha)
  except (FileNotFoundError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  if args.input:
    with open(args.input, encoding="utf-8") as f:
      lines = f.read().splitlines()
  else:
    lines = sys.stdin.read().splitlines()
  logging.info("translating %d lines with %s (%s)", len(lines), run.checkpoint,
               "greedy" if run.config.eval.beam_size == 1 else f"beam {run.config.eval.beam_size}")
  hypotheses = translate_lines(run, lines)
  if jax.process_index() != 0:
    return 0
  text = "".join(h + "\n" for h in hypotheses)
  if args.output:
    with open(args.output, "w", encoding="utf-8") as f:
      f.write(text)
  else:
    sys.stdout.write(text)
  return 0


if __name__ == "__main__":
  _define_flags()
  app.run(main)
