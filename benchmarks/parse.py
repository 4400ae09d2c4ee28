"""Parsing speed and accuracy of a trained §6.3 run on its validation sentences: one JSON line.

  python benchmarks/parse.py --workdir DIR [--beam_sizes 1,4,21] [--repeats 3]
      [--batch_tokens N] [--shapes fast|few|auto] [--checkpoint auto] [--[no]tree_constraints]
      [--command]

The sentences are the run's validation split (`config.data.eval_split`, all of it), parsed from
their words as a user parses them (`Parser.parse_restored`: encoding, the search, the trees); the
run is loaded once. Per beam size: `cold_s`, the first call (every search shape compiled; no
compilation cache), `warm_s`, the median of `--repeats` later calls, sentences/s of each,
the decoder steps and row-steps (sentences decoded at each step, summed) and the EVALB F1,
precision and recall of the trees against the gold ones (COLLINS.prm, tasks/parsing/evalb.py).

`--command` also times the whole `python -m transformer_jax.parse` command (start-up and
loading included) on the same sentences: once with an empty compilation cache (`cold`), then
`--repeats` times with the cache it left (`warm`, median), each in a fresh process.
"""

import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app, flags

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from anywhere

from benchmarks import machine  # noqa: E402

_WORKDIR = flags.DEFINE_string("workdir", None, "A parsing run's --workdir.", required=True)
_CHECKPOINT = flags.DEFINE_string(
    "checkpoint", "auto", "A step number, 'latest', 'avg' or 'auto' (see inference.load_run)."
)
_BEAMS = flags.DEFINE_list("beam_sizes", [], "Beam sizes to time (default: the run's).")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed warm calls per beam size (the median).")
_BATCH_TOKENS = flags.DEFINE_integer(
    "batch_tokens", None, "Source tokens per batch (default: the run's eval.batch_tokens)."
)
_CONSTRAINTS = flags.DEFINE_bool(
    "tree_constraints", None, "Decode only well-formed trees (default: the run's)."
)
_SHAPES = flags.DEFINE_enum(
    "shapes",
    "fast",
    ["auto", "fast", "few"],
    "The search's batch shapes (decoding/batch_shapes.py); the command's default is the run's.",
)
_COMMAND = flags.DEFINE_bool(
    "command", False, "Also time the parse command, cold and warm, in fresh processes."
)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if _REPEATS.value < 1:
    raise app.UsageError(f"--repeats={_REPEATS.value}: must be >= 1")
  import jax

  from transformer_jax.data import pipeline
  from transformer_jax.tasks.parsing import evalb, parser, scoring, trees

  loaded = parser.Parser.load(
      _WORKDIR.value, _CHECKPOINT.value, tree_constraints=_CONSTRAINTS.value, shapes=_SHAPES.value
  )
  run = loaded.run
  if _BATCH_TOKENS.value is not None:
    run.config.eval.batch_tokens = _BATCH_TOKENS.value
  pairs = pipeline.load_dataset(run.config, _WORKDIR.value).splits["eval"].pairs
  sentences = [source.split() for source, _ in pairs]
  linearization = trees.Linearization.from_config(run.config.parsing)
  gold = [str(t) for t in scoring.gold_trees(pairs, linearization)]
  device = jax.devices()[0]
  result = {
      "workdir": _WORKDIR.value,
      "checkpoint": run.checkpoint,
      "device": device.device_kind,
      **machine.describe(),
      "cpus": len(os.sched_getaffinity(0)),
      "sentences": len(sentences),
      "words": sum(map(len, sentences)),
      "alpha": run.alpha,
      "tree_constraints": run.config.parsing.tree_constraints,
      "batch_tokens": run.config.eval.batch_tokens,
      "shapes": _SHAPES.value,
  }
  beams = [int(b) for b in _BEAMS.value] or [run.beam_size]
  for beam in beams:
    start = time.perf_counter()
    loaded.parse_restored(sentences, beam_size=beam)  # compiles every shape it needs
    cold = time.perf_counter() - start
    times, stats = [], {}
    for _ in range(_REPEATS.value):
      stats.clear()
      start = time.perf_counter()
      restored = loaded.parse_restored(sentences, beam_size=beam, stats=stats)
      times.append(time.perf_counter() - start)
    warm = statistics.median(times)
    scores = evalb.score(gold, [str(r.tree) for r in restored]).all
    result[f"beam{beam}"] = {
        "cold_s": round(cold, 2),
        "cold_sentences_per_s": round(len(sentences) / cold, 1),
        "warm_s": round(warm, 3),
        "warm_times": [round(t, 3) for t in times],
        "warm_sentences_per_s": round(len(sentences) / warm, 1),
        "f1": round(scores.f1, 2),
        "precision": round(scores.precision, 2),
        "recall": round(scores.recall, 2),
        "repaired": sum(r.repairs > 0 for r in restored),
        **{k: stats[k] for k in ("batches", "rows", "steps", "row_steps")},
        "step_ms": round(1000 * warm / max(stats["steps"], 1), 2),
    }
  if _COMMAND.value:
    result["command"] = {f"beam{b}": _time_command(sentences, b) for b in beams}
  print(json.dumps(result))


def _time_command(sentences, beam: int) -> dict:
  """The parse command's wall time on `sentences`: cold (empty cache), then warm (median)."""
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "sentences.txt")
    pathlib.Path(path).write_text("".join(" ".join(s) + "\n" for s in sentences), "utf-8")
    command = [
        sys.executable, "-m", "transformer_jax.parse", f"--workdir={_WORKDIR.value}",
        f"--checkpoint={_CHECKPOINT.value}", f"--beam_size={beam}", f"--input={path}",
        f"--output={os.path.join(tmp, 'trees.mrg')}", f"--shapes={_SHAPES.value}",
        f"--compilation_cache={os.path.join(tmp, 'cache')}",
    ]  # fmt: skip
    if _CONSTRAINTS.value is not None:
      command.append(f"--{'' if _CONSTRAINTS.value else 'no'}tree_constraints")
    if _BATCH_TOKENS.value is not None:
      command.append(f"--batch_tokens={_BATCH_TOKENS.value}")
    root = str(pathlib.Path(__file__).resolve().parents[1])
    times = []
    for _ in range(1 + _REPEATS.value):
      start = time.perf_counter()
      subprocess.run(command, check=True, cwd=root, capture_output=True)
      times.append(time.perf_counter() - start)
  warm = statistics.median(times[1:])
  return {
      "cold_s": round(times[0], 2),
      "warm_s": round(warm, 2),
      "warm_times": [round(t, 2) for t in times[1:]],
      "warm_sentences_per_s": round(len(sentences) / warm, 1),
  }


if __name__ == "__main__":
  app.run(main)
