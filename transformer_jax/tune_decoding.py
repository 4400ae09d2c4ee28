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
value of one decoding key of the run's config (on ties, the first listed). Prints one JSON line
and writes it to `DIR/decoding_sweep.json`. Put the chosen values in the config
(`eval.beam_size`, `eval.alpha`, ...) so the run's own final evaluation uses them.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib

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
      "KEY=V1,V2: also try each value of a decoding key of the run's config "
      "(e.g. parsing.tree_constraints=false,true); on ties the first listed wins.",
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
  run's own); the parameters are shared.
  """
  from transformer_jax.data import pipeline
  from transformer_jax.runs import inference  # heavy (JAX); keeps --help fast

  if not alphas:
    raise errors.UserError("no α to try: --alphas is empty")
  if any(a < 0 for a in alphas):
    raise errors.UserError(f"--alphas={alphas}: a length penalty must be >= 0")
  if beam_sizes and any(k < 1 for k in beam_sizes):
    raise errors.UserError(f"--beam_sizes={beam_sizes}: a beam size must be >= 1")
  run = inference.load_run(workdir, which)
  task, config = run.task, run.config
  if not task.metric:
    raise errors.UserError(f"the {task.name} task names no metric (Task.metric) to choose by")
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


def parse_try(text: str) -> tuple[str, list] | None:
  """--try "section.key=V1,V2" -> ("section.key", [V1, V2]): true/false as booleans, numbers as
  numbers, anything else as text (the run's config checks each value when it is set)."""
  if not text.strip():
    return None
  key, sep, values = text.partition("=")
  items = [v.strip() for v in values.split(",") if v.strip()]
  if not sep or not key.strip() or not items:
    raise errors.UserError(
        f"--try={text!r}: expected KEY=V1,V2 (e.g. parsing.tree_constraints=false,true)"
    )
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
  return key.strip(), out


def main(argv):
  args = cli.workdir_args(argv)
  alphas = _parse_list("alphas", args.alphas, float)
  beam_sizes = _parse_list("beam_sizes", args.beam_sizes, int)
  values = parse_try(getattr(args, "try"))
  print(json.dumps(tune(args.workdir, alphas, beam_sizes, args.checkpoint, values)))
  return 0


if __name__ == "__main__":
  _define_flags()
  cli.run(main)
