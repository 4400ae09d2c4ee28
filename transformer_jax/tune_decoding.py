"""Chooses beam size and length penalty α on the development set, as §6.1 did, then scores test.

  python -m transformer_jax.tune_decoding --workdir DIR [--alphas 0.6,0.8,1.0,1.2]
      [--beam_sizes 4] [--checkpoint auto] [--tree_constraints false,true]

§6.1: beam size and α "were chosen after experimentation on the development set". For each
(beam size, α) pair the run's whole validation split (`config.data.eval_split`) is decoded and
scored with sacreBLEU; the pair with the best validation BLEU (on ties the smaller beam, then the
smaller α) then decodes the test split once. Prints one JSON line and writes it to
`DIR/decoding_sweep.json`, with the test translations in `DIR/test_translations.tuned.txt`. A
parsing run (§6.3, config.task=parsing) is scored by EVALB's F1 instead (scoring.py), and its test
parses go to `DIR/test_trees.tuned.mrg` (§6.3 chose the beam size on section 22); with
`--tree_constraints false,true` it also tries the search with and without
`parsing.tree_constraints` (tree_constraint.py; on ties, without). Put the chosen values in the
config (`eval.beam_size`, `eval.alpha`, ...) so the run's own final evaluation uses them.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib

from absl import flags

from transformer_jax import cli, errors, files
from transformer_jax.tasks import bleu


def _define_flags():
  # Defined only when run as a program, so importing this module defines no flags.
  flags.DEFINE_string("workdir", None, "The training run's --workdir.")
  flags.DEFINE_string("alphas", "0.6,0.8,1.0,1.2", "Comma-separated length penalties to try.")
  flags.DEFINE_string(
      "beam_sizes", "", "Comma-separated beam sizes to try; default: the run's (eval.beam_size)."
  )
  flags.DEFINE_string("checkpoint", "auto", "Which parameters (see inference.load_run).")
  flags.DEFINE_string(
      "tree_constraints",
      "",
      "Parsing runs: comma-separated true/false values of parsing.tree_constraints to try; "
      "default: the run's.",
  )


def _score(hypotheses: list[str], references: list[str]) -> dict:
  corpus = bleu.corpus_bleu(hypotheses, references)
  return {
      "bleu": float(corpus.score),
      "length_ratio": float(corpus.sys_len / max(corpus.ref_len, 1)),
  }


def tune(
    workdir: str,
    alphas: list[float],
    beam_sizes: list[int] | None = None,
    which: str = "auto",
    tree_constraints: list[bool] | None = None,
) -> dict:
  """Validation BLEU for each (beam size, α), the best pair, and the test scores decoded with it.

  `beam_sizes` None or empty: the run's own `eval.beam_size` only. The run is loaded once; α is
  an argument of its compiled search, so the search compiles once per (batch shape, beam size)
  however many α are tried (`search_compilations` in the result). `tree_constraints` (parsing
  runs only; None or empty: the run's own setting) are the values of `parsing.tree_constraints`
  to try.
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
  if tree_constraints and run.config.task != "parsing":
    raise errors.UserError(
        "--tree_constraints applies to parsing runs (config.task='parsing') only"
    )
  dataset = pipeline.load_dataset(run.config, workdir)  # reuses the run's vocabulary
  valid, test = dataset.splits["eval"], dataset.splits["test"]
  lang = run.config.data.target_lang
  beams = list(beam_sizes) if beam_sizes else [run.beam_size]

  def decode(beam, alpha, split, run=run):
    return run.translate_ids([s for s, _ in split.examples], beam_size=beam, alpha=alpha)

  if run.config.task == "parsing":  # §6.3: beam and α chosen on validation F1 (EVALB)
    values = tree_constraints or [run.config.parsing.tree_constraints]
    runs = {
        v: run.with_overrides({"parsing.tree_constraints": v}) for v in values
    }  # parameters shared
    return _tune_parsing(workdir, runs, decode, valid, test, alphas, beams)

  sweep = []
  for beam in beams:
    for alpha in alphas:
      scores = _score(decode(beam, alpha, valid), [t for _, t in valid.pairs])
      sweep.append(
          {"beam_size": beam, "alpha": alpha, **{f"valid_{k}": v for k, v in scores.items()}}
      )
      logging.info(
          "beam %d, α=%g: validation BLEU %.2f (length ratio %.3f)",
          beam,
          alpha,
          scores["bleu"],
          scores["length_ratio"],
      )
  best = max(sweep, key=lambda r: (r["valid_bleu"], -r["beam_size"], -r["alpha"]))
  hypotheses = decode(best["beam_size"], best["alpha"], test)
  references = [t for _, t in test.pairs]
  test_scores = _score(hypotheses, references)
  logging.info(
      "the search compiled %d times (%d α values, beam sizes %s)",
      run.predictor.searches(),
      len(alphas),
      beams,
  )
  result = {
      **_chosen(workdir, run, sweep, best),
      "test_bleu": test_scores["bleu"],
      "test_length_ratio": test_scores["length_ratio"],
      "test_tokenized_bleu": float(bleu.tokenized_bleu(hypotheses, references, lang).score),
      "test_tokenized_bleu_lowercase": float(
          bleu.tokenized_bleu(hypotheses, references, lang, lowercase=True).score
      ),
      "test_sentences": len(references),
      "search_compilations": run.predictor.searches(),
  }
  text = "".join(h + "\n" for h in hypotheses)
  files.atomic_write(
      os.path.join(workdir, "test_translations.tuned.txt"),
      lambda tmp: pathlib.Path(tmp).write_text(text, encoding="utf-8"),
  )
  files.atomic_write(
      os.path.join(workdir, "decoding_sweep.json"),
      lambda tmp: pathlib.Path(tmp).write_text(json.dumps(result, indent=2)),
  )
  return result


def _chosen(workdir, run, sweep: list[dict], best: dict) -> dict:
  """The head of decoding_sweep.json: the run, every setting tried and the one chosen."""
  return {
      "workdir": workdir,
      "parameters": run.checkpoint,
      "sweep": sweep,
      "best_beam_size": best["beam_size"],
      "best_alpha": best["alpha"],
  }


def _tune_parsing(workdir, runs: dict, decode, valid, test, alphas, beams) -> dict:
  """`tune` for a parsing run: validation F1 per (tree constraints, beam, α), `runs` holding
  the loaded run for each `parsing.tree_constraints` value to try; test_trees.tuned.mrg."""
  from transformer_jax.tasks.parsing import scoring, trees

  run = next(iter(runs.values()))
  linearization = trees.Linearization.from_config(run.config.parsing)
  sweep = []
  for constrained, loaded in runs.items():
    for beam in beams:
      for alpha in alphas:
        hypotheses = decode(beam, alpha, valid, loaded)
        scores = scoring.scores(hypotheses, valid.pairs, linearization)[0]
        sweep.append(
            {
                "tree_constraints": constrained,
                "beam_size": beam,
                "alpha": alpha,
                "valid_f1": scores["f1"],
                "valid_repaired": scores["repaired"],
                "valid_evalb_error_sentences": scores["evalb_error_sentences"],
            }
        )
        logging.info(
            "tree constraints %s, beam %d, α=%g: validation F1 %.2f (%d repaired)",
            constrained, beam, alpha, scores["f1"], scores["repaired"],
        )  # fmt: skip
  best = max(
      sweep,
      key=lambda r: (r["valid_f1"], -r["tree_constraints"], -r["beam_size"], -r["alpha"]),
  )
  chosen = runs[best["tree_constraints"]]
  hypotheses = decode(best["beam_size"], best["alpha"], test, chosen)
  test_scores = scoring.test_results(
      hypotheses, test.pairs, linearization, workdir, trees_file="test_trees.tuned.mrg"
  )
  result = {
      **_chosen(workdir, chosen, sweep, best),
      "best_tree_constraints": best["tree_constraints"],
      **test_scores,
      "test_sentences": len(test.pairs),
      "search_compilations": sum(r.predictor.searches() for r in runs.values()),
  }
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


def main(argv):
  args = cli.workdir_args(argv)
  alphas = _parse_list("alphas", args.alphas, float)
  beam_sizes = _parse_list("beam_sizes", args.beam_sizes, int)
  constraints = _parse_list("tree_constraints", args.tree_constraints, boolean)
  print(json.dumps(tune(args.workdir, alphas, beam_sizes, args.checkpoint, constraints)))
  return 0


if __name__ == "__main__":
  _define_flags()
  cli.run(main)
