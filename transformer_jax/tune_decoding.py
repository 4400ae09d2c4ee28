"""Chooses beam size and length penalty α on the development set, as §6.1 did, then scores test.

  python -m transformer_jax.tune_decoding --workdir DIR [--alphas 0.6,0.8,1.0,1.2]
      [--beam_sizes 4] [--checkpoint auto] [--try parsing.tree_constraints=false,true]

§6.1: beam size and α "were chosen after experimentation on the development set". For each
(beam size, α) pair the run's whole validation split (`config.data.eval_split`) is decoded and
scored by the run's task (`Task.scores`: sacreBLEU for translation, EVALB's F1 for §6.3 parsing,
which chose its beam size on section 22); the pair with the best validation score (the task's
`metric`; on ties the smaller beam, then the smaller α) then decodes the test split once, scored
and written as the task's final evaluation is (`Task.test_results`), under names marked `tuned`:
`DIR/test_translations.tuned.txt`, `DIR/test_trees.tuned.mrg`. `--try KEY=V1,V2` also tries each
value of one decoding key of the run's config (on ties, the first listed): one that changes what
the search writes, `eval.beam_stop`, `eval.matmul_dtype`, `eval.max_decode_extra`
(config.DECODING_KEYS) or one its task declares (`Task.decoding_keys`: a parsing run's
`parsing.tree_constraints`). Another key (one of the model's or training's, one that changes only
the speed, a typo), a value of another type than the run's, or one the config's checks refuse
is an error naming the key and the keys --try takes, before any parameters or data are read.
Prints one JSON line and writes it to `DIR/decoding_sweep.json`. Put the chosen values in the
config (`eval.beam_size`, `eval.alpha`, ...) so the run's own final evaluation uses them.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib

import ml_collections
from absl import flags

from transformer_jax import cli, errors, files


def _define_flags():
  # Defined only when run as a program, so importing this module defines no flags.
  flags.DEFINE_string("workdir", None, "The training run's --workdir.")
  flags.DEFINE_string("alphas", "0.6,0.8,1.0,1.2", "Comma-separated length penalties to try.")
  flags.DEFINE_string(
      "beam_sizes", "", "Comma-separated beam sizes to try; default: the run's (eval.beam_size)."
  )
  flags.DEFINE_string("checkpoint", "auto", "Which parameters (see inference.load_run).")
  flags.DEFINE_string(
      "try",
      "",
      "KEY=V1,V2: also try each value of one decoding key of the run's config, one that "
      "changes what the search writes: eval.beam_stop, eval.matmul_dtype, eval.max_decode_extra, "
      "or the task's (a parsing run's parsing.tree_constraints); each value of the type of the "
      "run's (e.g. eval.beam_stop=proven,k_finished). Beam sizes and α have --beam_sizes and "
      "--alphas. On ties the first listed wins.",
  )


def tune(
    workdir: str,
    alphas: list[float],
    beam_sizes: list[int] | None = None,
    which: str = "auto",
    values: tuple[str, list] | None = None,
) -> dict:
  """The task's validation scores for each (beam size, α), the best pair, and the test scores
  decoded with it.

  `beam_sizes` None or empty: the run's own `eval.beam_size` only. The run is loaded once; α is
  an argument of its compiled search, so the search compiles once per (batch shape, beam size)
  however many α are tried (`search_compilations` in the result). `values` ("section.key",
  [value, ...]): the values of a decoding key of the run's config to try as well (None: the
  run's own), checked by `check_try` before anything else is loaded (texts, as --try gives them,
  converted to the key's type); the parameters are shared.
  """
  from transformer_jax import tasks
  from transformer_jax.data import pipeline
  from transformer_jax.runs import inference  # heavy (JAX); keeps --help fast

  if not alphas:
    raise errors.UserError("no α to try: --alphas is empty")
  if any(a < 0 for a in alphas):
    raise errors.UserError(f"--alphas={alphas}: a length penalty must be >= 0")
  if beam_sizes and any(k < 1 for k in beam_sizes):
    raise errors.UserError(f"--beam_sizes={beam_sizes}: a beam size must be >= 1")
  # The run's config alone first: a wrong --try is refused before parameters or data are read.
  saved = inference.load_config(workdir)
  task = tasks.get(saved.task)
  if not task.metric:
    raise errors.UserError(f"the {task.name} task names no metric (Task.metric) to choose by")
  if values:
    values = (values[0], check_try(saved, task, *values))
  run = inference.load_run(workdir, which)
  config = run.config
  key, tried = values if values else (None, [None])
  # One loaded run per value of the key (the parameters shared): its search built for it.
  runs = [run if key is None else run.with_overrides({key: v}) for v in tried]
  dataset = pipeline.load_dataset(config, workdir, task=task)  # reuses the run's vocabulary
  valid, test = dataset.splits["eval"], dataset.splits["test"]
  beams = list(beam_sizes) if beam_sizes else [run.beam_size]

  def decode(loaded, beam, alpha, split):
    return loaded.decode_ids([s for s, _ in split.examples], beam_size=beam, alpha=alpha)

  sweep = []
  for index, loaded in enumerate(runs):
    for beam in beams:
      for alpha in alphas:
        scores = task.scores(loaded.config, decode(loaded, beam, alpha, valid), valid.pairs)
        row = {key: tried[index]} if key else {}
        row.update(beam_size=beam, alpha=alpha, **{f"valid_{k}": v for k, v in scores.items()})
        sweep.append(row)
        logging.info(
            "%sbeam %d, α=%g: validation %s %.2f",
            f"{key}={tried[index]}, " if key else "",
            beam,
            alpha,
            task.metric,
            scores[task.metric],
        )
  order = {v: i for i, v in enumerate(tried)}
  best = max(
      sweep,
      key=lambda r: (
          r[f"valid_{task.metric}"],
          -order[r[key]] if key else 0,
          -r["beam_size"],
          -r["alpha"],
      ),
  )
  chosen = runs[order[best[key]]] if key else run
  hypotheses = decode(chosen, best["beam_size"], best["alpha"], test)
  result = {
      "workdir": workdir,
      "parameters": run.checkpoint,
      "sweep": sweep,
      **({f"best_{key}": best[key]} if key else {}),
      "best_beam_size": best["beam_size"],
      "best_alpha": best["alpha"],
      **task.test_results(chosen.config, hypotheses, test.pairs, workdir, tag="tuned"),
      "test_sentences": len(test.pairs),
      "search_compilations": sum(r.predictor.searches() for r in runs),
  }
  logging.info(
      "the search compiled %d times (%d α values, beam sizes %s)",
      result["search_compilations"],
      len(alphas),
      beams,
  )
  files.atomic_write(
      os.path.join(workdir, "decoding_sweep.json"),
      lambda tmp: pathlib.Path(tmp).write_text(json.dumps(result, indent=2)),
  )
  return result


def _parse_list(name: str, text: str, kind: type) -> list:
  try:
    return [kind(x) for x in text.split(",") if x.strip()]
  except ValueError:
    raise errors.UserError(
        f"--{name}={text!r} is not a comma-separated list of {kind.__name__} values"
    ) from None


def boolean(text: str) -> bool:
  """true/false (or 1/0), any case."""
  value = {"true": True, "1": True, "false": False, "0": False}.get(text.strip().lower())
  if value is None:
    raise ValueError(text)
  return value


def split_try(text: str) -> tuple[str, list[str]] | None:
  """--try "section.key=V1,V2" -> ("section.key", ["V1", "V2"]), the values as written (None for
  an empty flag); `check_try` converts them to the key's type."""
  if not text.strip():
    return None
  key, sep, values = text.partition("=")
  items = [v.strip() for v in values.split(",") if v.strip()]
  if not sep or not key.strip() or not items:
    raise errors.UserError(
        f"--try={text!r}: expected KEY=V1,V2 (e.g. parsing.tree_constraints=false,true)"
    )
  return key.strip(), items


def parse_try(text: str) -> tuple[str, list] | None:
  """--try "section.key=V1,V2" -> ("section.key", [V1, V2]): true/false as booleans, numbers as
  numbers, anything else as text, without the run's config (`tune` checks each value against
  it)."""
  split = split_try(text)
  if split is None:
    return None
  key, items = split
  out = []
  for item in items:
    for kind in (boolean, int, float):
      try:
        out.append(kind(item))
        break
      except ValueError:
        continue
    else:
      out.append(item)
  return key, out


def check_try(config, task, key: str, values: list) -> list:
  """The values of --try `key` for a run of `task` whose config is `config`, each of the type of
  the key's value there (a text from the command line converted to it), or a UserError naming
  the key and the keys --try takes: for a key that is not a decoding setting (config.py
  `decoding_keys`: one of config.eval's that change the outputs, or of the task's), a value of
  another type, or one the config's checks refuse. Nothing is loaded but the config."""
  from transformer_jax import config as config_lib
  from transformer_jax.runs import inference

  accepted = config_lib.decoding_keys(task)
  takes = f"--try takes {', '.join(accepted)}"
  if key not in accepted:
    try:
      config_lib.config_value(config, key)
    except (KeyError, AttributeError, TypeError):
      raise errors.UserError(f"--try {key}: the run's config has no such key; {takes}") from None
    why = {
        "eval.beam_size": "beam sizes are tried with --beam_sizes",
        "eval.alpha": "length penalties are tried with --alphas",
        **dict.fromkeys(
            ("eval.batch_tokens", "eval.shapes", "eval.refill"),
            "it changes how fast the search runs, not what it writes",
        ),
    }.get(key, "not a decoding setting")
    raise errors.UserError(f"--try {key}: {why}; {takes}")
  current = config_lib.config_value(config, key)
  out = []
  for value in values:
    typed = _typed(value, type(current))
    if typed is None:
      raise errors.UserError(
          f"--try {key}={value!r}: {key} takes {type(current).__name__} values (the run's is "
          f"{current!r}); {takes}"
      )
    trial = ml_collections.ConfigDict(config.to_dict())
    inference.set_values(trial, {key: typed})
    try:
      config_lib.validate(trial, task)
    except errors.UserError as e:
      raise errors.UserError(f"--try {key}={typed!r}: {e}; {takes}") from None
    out.append(typed)
  return out


def _typed(value, kind: type):
  """`value` as a `kind` (bool, int, float or str), or None where it is not one: a text is
  converted (true/false, a number), an int stands for a float, nothing else is changed."""
  if isinstance(value, str) and kind is not str:
    try:
      return boolean(value) if kind is bool else kind(value.strip())
    except ValueError:
      return None
  if kind is float and isinstance(value, int) and not isinstance(value, bool):
    return float(value)
  if isinstance(value, kind) and (kind is bool or not isinstance(value, bool)):
    return value
  return None


def main(argv):
  args = cli.workdir_args(argv)
  alphas = _parse_list("alphas", args.alphas, float)
  beam_sizes = _parse_list("beam_sizes", args.beam_sizes, int)
  values = split_try(getattr(args, "try"))  # as written: tune converts them to the key's type
  print(json.dumps(tune(args.workdir, alphas, beam_sizes, args.checkpoint, values)))
  return 0


if __name__ == "__main__":
  _define_flags()
  cli.run(main)
