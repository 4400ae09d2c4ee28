"""Parse sentences with a trained §6.3 parsing run: one sentence in, one bracketed tree out.

  python -m transformer_jax.parse --workdir DIR [--checkpoint auto|STEP|latest|avg]
      [--beam_size 21] [--alpha 0.3] [--[no]tree_constraints] [--batch_tokens N]
      < sentences.txt > trees.mrg
  python -m transformer_jax.parse --workdir DIR --input sentences.txt --output trees.mrg
  python -m transformer_jax.parse --workdir DIR --tokenize < plain_sentences.txt > trees.mrg

Each input line is one sentence, tokenized as the Penn Treebank is (words separated by spaces:
`The company 's shares rose 5 % .`); brackets are written as the treebank writes them
(`(` -> `-LRB-`). With `--tokenize` a line is plain text (`The company's shares rose 5%.`),
split into those tokens by NLTK's Treebank tokenizer (tasks/parsing/parser.py, which also parses
from Python into nltk.Tree objects). Each output line is its tree, with the part-of-speech tags
the model predicted, under a TOP node, as EVALB reads it:

    (TOP (S (NP (DT The) (NN company) (POS 's) (NNS shares)) (VP (VBD rose) ...) (. .)))

The search is the run's (§6.3: beam 21, α 0.3, output length up to input + 300) unless the flags
say otherwise (on configs/parsing_sample.py's run, 2 CPU cores: beam 21 parses ~4 sentences/s,
`--beam_size 3` ~50 at 1.1 validation F1 less, `--beam_size 1` ~140 at 3.9 less, `--shapes fast`
once compiled; docs/parsing.md). `--tree_constraints` makes it write only well-formed trees over
the sentence's words (tree_constraint.py; default: the run's `parsing.tree_constraints`). An
output that is not a well-formed tree is repaired by tasks/parsing/trees.py's rule, and how many
were is printed to stderr.
The whole input is checked before the model is loaded: an empty line, a line with more words
than the model reads (config.data.max_len - 1) or a line that is not UTF-8 stops the program
with one `error:` line naming the line (a UTF-8 byte-order mark opening the input is dropped), as
does an --output that cannot be written. The trees are written once every sentence is parsed (an
--output file whole or not at all): Ctrl-C before then writes none, ending with status 130.

Compiled searches are kept as translate keeps them (JAX's persistent compilation cache and the
programs exported beside it; `--compilation_cache`, empty to turn it off), so a later call
neither compiles nor traces them again.
"""

from __future__ import annotations

import logging
import sys

from absl import flags

from transformer_jax import cli, errors, files, tasks


def _define_flags():
  # Defined only when run as a program, so importing this module defines no flags.
  flags.DEFINE_string("workdir", None, "The --workdir of a parsing training run.")
  flags.DEFINE_string(
      "checkpoint",
      "auto",
      "A step number, 'latest', 'avg', or 'auto' (what the run's final evaluation used).",
  )
  flags.DEFINE_integer("beam_size", None, "Beam size (1 = greedy); default: the run's.")
  flags.DEFINE_float("alpha", None, "Length penalty α; default: the run's.")
  flags.DEFINE_bool(
      "tree_constraints",
      None,
      "Decode only well-formed trees over the input's words; default: the run's.",
  )
  flags.DEFINE_bool(
      "tokenize",
      False,
      "Each line is plain text, split into Penn Treebank tokens (NLTK's Treebank tokenizer: "
      "contractions, quotes, brackets and numbers as the treebank writes them); default: the "
      "line's words are already tokens, separated by spaces.",
  )
  flags.DEFINE_string("input", None, "Input file (default: standard input).")
  flags.DEFINE_string("output", None, "Output file (default: standard output).")
  cli.define_batch_tokens_flag()
  cli.define_shapes_flag()
  cli.define_beam_stop_flag()
  cli.define_compilation_cache_flag()


def read_sentences(stream, name: str, max_words: int, tokenize: bool = False) -> list[list[str]]:
  """The words of every line of `stream` (binary): split on spaces, or with `tokenize` split
  into Penn Treebank tokens from plain text; a UserError names the first bad line."""
  from transformer_jax.tasks.parsing import parser

  sentences = []
  for number, line in enumerate(cli.read_lines(stream, name), start=1):
    words = parser.words_of(line, tokenized=not tokenize)
    parser.check_words(words, max_words, f"{name} line {number}")
    sentences.append(words)
  return sentences


def main(argv):
  args = cli.workdir_args(argv)
  cli.check_batch_tokens(args.batch_tokens)
  tasks.check_command(args.workdir, "parse")  # a translation run: one line naming translate
  if args.output:
    cli.check_output_file(args.output)  # before the run is loaded and anything parsed
  from transformer_jax.decoding import compilation, saved_programs  # heavy (JAX): not for --help
  from transformer_jax.runs import inference  # heavy (JAX): not for --help
  from transformer_jax.tasks.parsing import parser

  overrides = cli.beam_stop_overrides(args.beam_stop)
  if args.tree_constraints is not None:
    overrides["parsing.tree_constraints"] = args.tree_constraints
  if args.batch_tokens is not None:
    overrides["eval.batch_tokens"] = args.batch_tokens
  config = inference.load_config(args.workdir, args.beam_size, args.alpha, overrides=overrides)
  if args.input:
    try:
      with open(args.input, "rb") as f:
        sentences = read_sentences(f, args.input, config.data.max_len - 1, args.tokenize)
    except OSError as e:
      raise errors.UserError(f"--input={args.input}: {e.strerror}") from None
  else:
    sentences = read_sentences(
        sys.stdin.buffer, "standard input", config.data.max_len - 1, args.tokenize
    )
  cache = compilation.enable_cache(args.compilation_cache)
  run = inference.load_run(
      args.workdir, args.checkpoint, args.beam_size, args.alpha,
      shapes=args.shapes, overrides=overrides,
  )  # fmt: skip
  saved = saved_programs.attach(run.predictor, cache)  # a later call traces nothing
  logging.info(
      "parsing %d sentences with %s (beam %d, α %g, tree constraints %s)",
      len(sentences),
      run.checkpoint,
      run.beam_size,
      run.alpha,
      run.config.parsing.tree_constraints,
  )
  with compilation.CompileLog() as log:
    restored = parser.Parser(run).parse_restored(sentences)
  text = "".join(f"{r.tree}\n" for r in restored)
  if args.output:  # whole or not at all: an interrupted program leaves no partial file

    def write(path):
      with open(path, "w", encoding="utf-8") as f:
        f.write(text)

    files.atomic_write(args.output, write)
  else:
    sys.stdout.write(text)
  repaired = sum(r.repairs > 0 for r in restored)
  print(compilation.summary(log, cache, saved), file=sys.stderr)
  print(
      f"parsed {len(restored)} sentences; {repaired} outputs were not well-formed trees and "
      "were repaired (tasks/parsing/trees.py)",
      file=sys.stderr,
  )
  sys.stdout.flush()
  return 0


def _main_or_interrupted(argv):
  """`main`; Ctrl-C ends it with one line and the shell's status for an interrupted program,
  130. The trees are written once every sentence is parsed, an --output file whole or not at
  all."""
  try:
    return main(argv)
  except KeyboardInterrupt:
    print("parse: interrupted (the trees are written once all are parsed)", file=sys.stderr)
    return 130


if __name__ == "__main__":
  _define_flags()
  cli.run(_main_or_interrupted)
