"""Chooses the length penalty α on the development set, as §6.1 did, then scores the test set.

  python -m transformer_jax.tune_decoding --workdir DIR [--alphas 0.6,0.8,1.0,1.2]
      [--beam_size 4] [--checkpoint auto]

§6.1: beam size and α "were chosen after experimentation on the development set". For each α
the run's whole validation split (`config.data.eval_split`) is decoded and scored with
sacreBLEU; the α with the best validation BLEU (the smallest on ties) then decodes the test split
once. Prints one JSON line and writes it to `DIR/decoding_sweep.json`, with the test translations
in `DIR/test_translations.tuned.txt`. Put the chosen value in the config (`eval.alpha`) so the
run's own final evaluation uses it.
"""

from __future__ import annotations

import json
import logging
import os
import sys

from absl import app, flags

from transformer_jax import cli, evaluate, translate
from transformer_jax.data import pipeline


def _define_flags():
  # Defined only when run as a program, so importing this module defines no flags.
  flags.DEFINE_string("workdir", None, "The training run's --workdir.")
  flags.DEFINE_string("alphas", "0.6,0.8,1.0,1.2", "Comma-separated length penalties to try.")
  flags.DEFINE_integer("beam_size", None, "Beam size; default: the run's (eval.beam_size).")
  flags.DEFINE_string("checkpoint", "auto", "Which parameters (see translate.load_run).")


def _score(hypotheses: list[str], references: list[str]) -> dict:
  bleu = evaluate.corpus_bleu(hypotheses, references)
  return {"bleu": float(bleu.score), "length_ratio": float(bleu.sys_len / max(bleu.ref_len, 1))}


def tune(workdir: str, alphas: list[float], beam_size=None, which: str = "auto") -> dict:
  """Validation BLEU for each α, the best α, and the test scores decoded with it."""
  if not alphas:
    raise ValueError("no α to try: --alphas is empty")
  if any(a < 0 for a in alphas):
    raise ValueError(f"--alphas={alphas}: a length penalty must be >= 0")
  first = translate.load_run(workdir, which, beam_size=beam_size, alpha=alphas[0])
  dataset = pipeline.load_dataset(first.config, workdir)  # reuses the run's vocabulary
  buckets = dataset.eval_bucket_lengths(first.config.data)
  valid, test = dataset.splits["eval"], dataset.splits["test"]
  lang = first.config.data.target_lang

  runs = {alphas[0]: first}  # one loaded run per α: its compiled search is reused for test

  def decode(alpha, split):
    if alpha not in runs:
      runs[alpha] = translate.load_run(workdir, which, beam_size, alpha)
    run = runs[alpha]
    return run.trainer.translate(run.params, split.examples, buckets, run.tokenizer)

  sweep = []
  for alpha in alphas:
    scores = _score(decode(alpha, valid), [t for _, t in valid.pairs])
    sweep.append({"alpha": alpha, **{f"valid_{k}": v for k, v in scores.items()}})
    logging.info("α=%g: validation BLEU %.2f (length ratio %.3f)", alpha, scores["bleu"],
                 scores["length_ratio"])
  best = max(sweep, key=lambda r: (r["valid_bleu"], -r["alpha"]))["alpha"]
  hypotheses = decode(best, test)
  references = [t for _, t in test.pairs]
  test_scores = _score(hypotheses, references)
  result = {
      "workdir": workdir,
      "parameters": first.checkpoint,
      "beam_size": first.config.eval.beam_size,
      "sweep": sweep,
      "best_alpha": best,
      "test_bleu": test_scores["bleu"],
      "test_length_ratio": test_scores["length_ratio"],
      "test_tokenized_bleu": float(evaluate.tokenized_bleu(hypotheses, references, lang).score),
      "test_tokenized_bleu_lowercase": float(
          evaluate.tokenized_bleu(hypotheses, references, lang, lowercase=True).score
      ),
      "test_sentences": len(references),
  }
  with open(os.path.join(workdir, "test_translations.tuned.txt"), "w", encoding="utf-8") as f:
    f.writelines(h + "\n" for h in hypotheses)
  with open(os.path.join(workdir, "decoding_sweep.json"), "w") as f:
    json.dump(result, f, indent=2)
  return result


def main(argv):
  args = cli.workdir_args(argv)
  try:
    alphas = [float(a) for a in args.alphas.split(",") if a.strip()]
  except ValueError:
    print(f"error: --alphas={args.alphas!r} is not a comma-separated list of numbers",
          file=sys.stderr)
    return 1
  try:
    result = tune(args.workdir, alphas, args.beam_size, args.checkpoint)
  except (FileNotFoundError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  print(json.dumps(result))
  return 0


if __name__ == "__main__":
  _define_flags()
  app.run(main)
