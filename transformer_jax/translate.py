"""Translate with a trained run: one line in, one line out, in order.

  python -m transformer_jax.translate --workdir DIR [--checkpoint auto|STEP|latest|avg]
      [--beam_size 4] [--alpha 0.6] [--batch_tokens 2048] [--shapes auto|fast|few]
      < input.txt > output.txt
  python -m transformer_jax.translate --workdir DIR --input in.txt --output out.txt

The input is read in chunks of --chunk_lines lines (a large file is never held whole); within a
chunk sentences are sorted by length and batched by tokens (inference.py), and each chunk is
written back in input order before the next is read. An empty line gives an empty line; a line
longer than the run's maximum length is truncated with a warning naming the line; a line that is
not UTF-8 stops the program with an error naming the file and line. At the end the speed
(sentences/s) goes to stderr.

Compiled searches are kept in JAX's persistent compilation cache (compilation.py): the
--compilation_cache directory, else the user's JAX_COMPILATION_CACHE_DIR, else
~/.cache/transformer_jax/jax_cache; a later call with the same model and shapes loads them
instead of compiling them. Beside them, in its transformer_jax_programs/, the searches' programs
are kept exported (saved_programs.py: jax.export's StableHLO), so that a later call does not
trace the model again either. `--compilation_cache=` (empty) turns both off.

A first call on a new machine is mostly compilation: one program per batch shape
(batch_shapes.py). `--shapes few` compiles several times fewer programs than `fast`, decoding
somewhat slower once compiled; `auto`, the default unless the run's eval.shapes says otherwise,
takes `few` for a chunk of fewer than 2,000 sentences and `fast` from the first larger one on.
The translations are the same (on a GPU all but a few near-ties). Measurements:
docs/benchmarks.md.

A parsing run is refused in one line naming `parse` (tasks.py).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Iterator

from absl import flags

from transformer_jax import cli, errors, tasks


def _chunks(lines: Iterator[str], size: int) -> Iterator[list[str]]:
  chunk = []
  for line in lines:
    chunk.append(line)
    if len(chunk) == size:
      yield chunk
      chunk = []
  if chunk:
    yield chunk


def _translate_stream(run, lines: Iterator[str], target, args) -> tuple[int, int, float]:
  """Translates `lines` chunk by chunk, writing each chunk in order to `target` (None: this
  process does not write). Returns (lines, sentences, seconds spent translating)."""
  count = sentences = 0
  seconds = 0.0
  for chunk in _chunks(lines, args.chunk_lines):
    start = time.perf_counter()
    hypotheses = run.decode_lines(chunk, batch_tokens=args.batch_tokens)
    seconds += time.perf_counter() - start
    count += len(chunk)
    sentences += sum(1 for line in chunk if line.strip())
    if target is not None:
      target.write("".join(h + "\n" for h in hypotheses))
      target.flush()
  return count, sentences, seconds


def _define_flags():
  # Defined only when run as a program, so importing this module defines no flags.
  flags.DEFINE_string("workdir", None, "The training run's --workdir.")
  flags.DEFINE_string(
      "checkpoint",
      "auto",
      "A step number, 'latest', 'avg', or 'auto' (what the run's final "
      "evaluation used: the average when train.average_last is set, else the latest).",
  )
  flags.DEFINE_integer("beam_size", None, "Beam size (1 = greedy); default: the run's.")
  flags.DEFINE_float("alpha", None, "Length penalty α; default: the run's.")
  flags.DEFINE_string("input", None, "Input file (default: standard input).")
  flags.DEFINE_string("output", None, "Output file (default: standard output).")
  flags.DEFINE_integer(
      "chunk_lines", 20_000, "Lines read, translated and written at a time (memory bound)."
  )
  cli.define_batch_tokens_flag()
  cli.define_shapes_flag()
  cli.define_beam_stop_flag()
  cli.define_matmul_dtype_flag()
  cli.define_compilation_cache_flag()


def main(argv):
  start = time.perf_counter()
  args = cli.workdir_args(argv)
  tasks.check_command(args.workdir, "translate")  # a parsing run: one line naming parse
  if args.chunk_lines < 1:
    raise errors.UserError(f"--chunk_lines={args.chunk_lines}: must be >= 1")
  cli.check_batch_tokens(args.batch_tokens)
  if args.input and not os.path.isfile(args.input):
    reason = "is a directory" if os.path.isdir(args.input) else "no such file"
    raise errors.UserError(f"--input={args.input}: {reason}")
  if args.output:
    cli.check_output_file(args.output)  # before the run is loaded and anything translated
  import jax  # heavy; keeps --help fast

  from transformer_jax.decoding import compilation, saved_programs
  from transformer_jax.runs import inference

  cache = compilation.enable_cache(args.compilation_cache)
  run = inference.load_run(
      args.workdir, args.checkpoint, args.beam_size, args.alpha, shapes=args.shapes,
      overrides=cli.decoding_overrides(args.beam_stop, args.matmul_dtype),
  )  # fmt: skip
  saved = saved_programs.attach(run.predictor, cache)  # a later call traces nothing
  search = "greedy" if run.beam_size == 1 else f"beam {run.beam_size}"
  if run.beam_size > 1 and run.config.eval.beam_stop != "proven":
    search += f", stop {run.config.eval.beam_stop}"
  if run.config.eval.get("matmul_dtype"):
    search += f", matmuls in {run.config.eval.matmul_dtype}"
  logging.info(
      "translating with %s (%s, α %g); compilation cache: %s", run.checkpoint, search, run.alpha,
      cache or "off",
  )  # fmt: skip
  if args.input:
    try:
      source = open(args.input, "rb")  # noqa: SIM115 - closed below
    except OSError as e:
      raise errors.UserError(f"--input={args.input}: {e.strerror}") from None
    name = args.input
  else:
    source, name = sys.stdin.buffer, "standard input"
  writer = jax.process_index() == 0
  target = open(args.output, "w", encoding="utf-8") if args.output and writer else sys.stdout  # noqa: SIM115
  try:
    with compilation.CompileLog() as log:
      lines, sentences, decode_seconds = _translate_stream(
          run, cli.read_lines(source, name), target if writer else None, args
      )
  finally:
    if source is not sys.stdin.buffer:
      source.close()
    if target is not sys.stdout:
      target.close()
  print(compilation.summary(log, cache, saved), file=sys.stderr)
  wall = time.perf_counter() - start
  print(
      f"translated {lines} lines ({sentences} sentences) in {wall:.1f} s: "
      f"{sentences / max(decode_seconds, 1e-9):.1f} sentences/s translating "
      f"({decode_seconds:.1f} s, compilation included), {sentences / max(wall, 1e-9):.1f} "
      "sentences/s from start to end",
      file=sys.stderr,
  )
  return 0


def _main_and_exit(argv):
  """`main`, then the process ends at once: everything is written and closed by then, and
  Python's teardown of the XLA runtime (freeing every loaded program and buffer) only makes
  the user wait, ~0.5 s on the 2-vCPU VM. Compilers skip freeing at exit for the same reason."""
  status = main(argv)
  sys.stdout.flush()
  sys.stderr.flush()
  logging.shutdown()
  os._exit(status or 0)


if __name__ == "__main__":
  _define_flags()
  cli.run(_main_and_exit)
