"""Training curves of one or more runs, from their `metrics.jsonl`, as one PNG.

  python -m transformer_jax.plot --workdir DIR [--workdir DIR2 ...] [--x step|time]
      [--output curves.png]

Four panels: training NLL (per target token, without label smoothing), perplexity on validation
(solid) and on as many training pairs with dropout off (dashed: the distance between the two is
the generalization gap), validation BLEU (periodic evaluations) and the learning rate (Eq. 3),
against the step or against wall-clock minutes of training. Several workdirs are drawn on the
same axes in one colour each, labelled by their directory names, to compare runs (e.g. the rows
of a Table 3 sweep).

A run resumed after interruptions is drawn as one curve: where a restart redid steps (it resumed
from a checkpoint older than its last log line) the later record wins, and wall time adds up
across restarts (each start's `elapsed_s` counts from zero). Prints one JSON line: the output
path and, per run, its last step, minutes, and final results where the run has them.
"""

from __future__ import annotations

import json
import os

from absl import app, flags

from transformer_jax import cli, figures, files
from transformer_jax.errors import UserError

SERIES = (  # (name, record kind, key, panel, line style)
    ("training NLL", "train", "nll", 0, "-"),
    ("validation perplexity", "eval", "perplexity", 1, "-"),
    ("training-pairs perplexity", "eval", "train_subset_perplexity", 1, "--"),
    ("validation BLEU (periodic subset)", "eval", "bleu", 2, "-"),
    ("learning rate", "train", "learning_rate", 3, "-"),
)
PANELS = (  # (title, log scale)
    ("training NLL", True),
    ("perplexity: validation (solid), training pairs, dropout off (dashed)", True),
    ("validation BLEU (periodic subset)", False),
    ("learning rate", False),
)


def _define_flags():
  flags.DEFINE_multi_string("workdir", [], "A training run's --workdir; repeat to compare runs.")
  flags.DEFINE_enum("x", "step", ["step", "time"], "Horizontal axis: step or training minutes.")
  flags.DEFINE_string("output", "", "PNG to write; default: WORKDIR/curves.png (first workdir).")


# What to do about a damaged line of metrics.jsonl: training only appends to it, and only this
# command and TensorBoard's copy of the numbers read it.
METRICS_FIX = "delete that line, or restore the file from a copy"
# And about a damaged results.json: training a finished run again evaluates it and writes it.
RESULTS_FIX = (
    "the file is damaged or cut short; delete it and run the training command on this --workdir "
    "again, whose final evaluation writes it anew"
)


def read_metrics(workdir: str) -> list[dict]:
  """The records of `workdir/metrics.jsonl`; a line that is not a record names file and line.

  FileNotFoundError if `workdir` holds no metrics.jsonl, UserError if it holds a damaged or an
  empty one. A last line cut short (training killed while writing it; training drops it when it
  resumes) is left out with a warning: the curves up to it are whole.
  """
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path} does not exist: is {workdir} the --workdir of a training run?")
  records = files.read_json_lines(path, keys=("step", "kind"), fix=METRICS_FIX)
  if not records:
    raise UserError(f"{path} is empty: the run has logged nothing yet")
  return records


def curves(records: list[dict], x: str = "step") -> dict[str, tuple[list[float], list[float]]]:
  """Series name -> (xs, ys), sorted by step; x is the step or cumulative training minutes."""
  offset, last_elapsed = 0.0, 0.0
  latest: dict[tuple[str, int], tuple[float, dict]] = {}
  for record in records:
    elapsed = record.get("elapsed_s")
    if record["kind"] == "start":  # a restart: its clock starts at zero
      offset, last_elapsed = offset + last_elapsed, 0.0
    elif elapsed is not None:
      if elapsed < last_elapsed:  # the same, in a file written before "start" records existed
        offset += last_elapsed
      last_elapsed = elapsed
    minutes = (offset + (elapsed if elapsed is not None else last_elapsed)) / 60.0
    latest[(record["kind"], int(record["step"]))] = (minutes, record)  # a redone step: later wins
  series = {}
  for name, kind, key, _, _ in SERIES:
    points = sorted(
        (step, minutes, record[key])
        for (k, step), (minutes, record) in latest.items()
        if k == kind and isinstance(record.get(key), (int, float))
    )
    series[name] = (
        [float(step if x == "step" else minutes) for step, minutes, _ in points],
        [float(value) for _, _, value in points],
    )
  return series


def plot(runs: dict[str, list[dict]], output: str, x: str = "step") -> None:
  """Draws every run's curves on four shared panels and writes `output` (PNG)."""
  plt = figures.pyplot()
  figure, axes = plt.subplots(2, 2, figsize=(11, 7), constrained_layout=True)
  for color, (label, records) in enumerate(runs.items()):
    series = curves(records, x)
    for name, _, _, panel, style in SERIES:
      xs, ys = series[name]
      if xs:
        axes.flat[panel].plot(
            xs,
            ys,
            style,
            color=f"C{color % 10}",
            marker="o" if len(xs) < 12 else None,
            markersize=3,
            label=label if panel == 0 else None,
        )
  for axis, (title, log_scale) in zip(axes.flat, PANELS):
    axis.set_title(title, fontsize=10)
    axis.set_xlabel("step" if x == "step" else "training minutes")
    axis.grid(alpha=0.3)
    if log_scale:
      axis.set_yscale("log")
  axes.flat[0].legend()
  figure.savefig(output, dpi=100)
  plt.close(figure)


def summary(workdir: str, records: list[dict]) -> dict:
  train = curves(records, "time")["training NLL"]
  steps = curves(records, "step")["training NLL"]
  out = {
      "workdir": workdir,
      "last_step": int(steps[0][-1]) if steps[0] else None,
      "training_minutes": round(train[0][-1], 1) if train[0] else None,
  }
  results = os.path.join(workdir, "results.json")
  if os.path.exists(results):
    final = files.read_json(results, fix=RESULTS_FIX)
    out.update({k: final[k] for k in ("test_bleu", "eval_perplexity") if k in final})
  return out


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  args = flags.FLAGS
  if not args.workdir:
    raise app.UsageError("--workdir is required (repeat it to compare runs)")
  try:
    runs = {os.path.basename(os.path.normpath(w)) or w: read_metrics(w) for w in args.workdir}
  except FileNotFoundError as e:
    raise UserError(f"--workdir: {e}") from None
  if len(runs) < len(args.workdir):
    raise UserError(
        f"--workdir {args.workdir}: two workdirs share a directory name, so the legend could "
        "not tell them apart"
    )
  output = args.output or os.path.join(args.workdir[0], "curves.png")
  figures.check_output(output)
  plot(runs, output, args.x)
  print(
      json.dumps(
          {
              "output": output,
              "runs": [summary(w, r) for w, r in zip(args.workdir, runs.values())],
          }
      )
  )


if __name__ == "__main__":
  _define_flags()
  cli.run(main)
