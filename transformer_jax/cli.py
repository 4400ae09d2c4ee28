"""What the command-line programs share: one way to report a user's mistake, and workdir flags.

Every program's `if __name__ == "__main__":` calls `cli.run(main)` instead of `absl.app.run`.
A `errors.UserError` (ConfigError, CheckpointError and CorpusError are ones) raised anywhere
below `main` then ends the program with one line on stderr, `error: <message>`, and status 1;
a wrong flag stays absl's `app.UsageError` (usage text, status 1). A UserError raised while the
flags are parsed (a config file's `get_config` rejecting its argument) and a `--config.KEY=VALUE`
naming no key are reported the same way.
"""

from __future__ import annotations

import codecs
import logging
import os
import sys
from collections.abc import Callable, Iterable, Iterator

import ml_collections
from absl import app, flags

from transformer_jax.decoding import batch_shapes  # plain Python: --help imports no JAX
from transformer_jax.errors import UserError
from transformer_jax.files import check_directory  # noqa: F401 - cli.check_directory for commands
from transformer_jax.parallel import host_memory


def run(main: Callable[[list[str]], object]) -> None:
  """`absl.app.run(main)`, with a UserError reported as `error: ...` and exit status 1; glibc's
  malloc set to keep the memory XLA's CPU runtime frees (parallel/host_memory.py) before `main`
  starts JAX's threads."""
  host_memory.reuse_freed_memory()

  def guarded(argv):
    try:
      return main(argv)
    except UserError as e:
      sys.exit(f"error: {e}")

  app.run(guarded, flags_parser=_parse_flags)


def _parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with the user's mistakes that surface there reported as one line.

  ml_collections builds a `--config FILE[:ARG]` while absl parses flags: a config's
  `get_config(ARG)` rejecting ARG raises a UserError, which absl re-raises as a flag error whose
  message holds a traceback; a `--config.KEY=VALUE` naming no key raises a KeyError (with
  ml_collections' "did you mean") through no flag error at all. Other flag errors read as absl
  writes them.
  """
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    if (cause := _first_user_error(e)) is not None:
      sys.exit(f"error: {cause}")
    sys.stderr.write(f"FATAL Flags parsing error: {e}\n")
    sys.stderr.write("Pass --helpshort or --helpfull to see help on flags.\n")
    sys.exit(1)
  except (AttributeError, KeyError) as e:
    if not _raised_in(e, ml_collections.__path__[0]):
      raise
    while e.args and isinstance(e.args[0], BaseException):  # AttributeError(KeyError(message))
      e = e.args[0]
    message = " ".join(str(e.args[0] if e.args else e).split())
    sys.exit(f"error: a --config.KEY=VALUE flag names no config key: {message}")


def _first_user_error(error: BaseException) -> UserError | None:
  """The UserError the chain of `error` began with (the deepest one), if there is one."""
  found, seen = None, set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if isinstance(error, UserError):
      found = error
    error = error.__cause__ or error.__context__
  return found


def _raised_in(error: BaseException, directory: str) -> bool:
  traceback = error.__traceback__
  while traceback is not None:
    if traceback.tb_frame.f_code.co_filename.startswith(directory):
      return True
    traceback = traceback.tb_next
  return False


def config_value(config_flag: flags.FlagHolder) -> ml_collections.ConfigDict:
  """The config of a `config_flags.DEFINE_config_file` flag; a UserError if its file is missing.

  ml_collections defers a config file's IOError until the config is first used, as a traceback.
  """
  config = config_flag.value
  if isinstance(config, ml_collections.ConfigDict):
    return config
  path = flags.FLAGS[config_flag.name].config_filename.split(":", 1)[0]
  try:
    config.keys()
  except OSError as e:
    reason = str(e).strip().splitlines()[-1].strip()
    if not os.path.exists(path):
      reason = f"no such file (from {os.getcwd()})"
    raise UserError(f"--{config_flag.name}={path}: {reason}") from None
  return config


def workdir_args(argv: list[str], required: str = "workdir") -> flags.FlagValues:
  """The parsed flags, after checking there are no stray arguments and --`required` is given;
  a --workdir (a training run's, which these commands read) must be a directory."""
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  args = flags.FLAGS
  if not getattr(args, required):
    raise app.UsageError(f"--{required} is required")
  if required == "workdir" and not os.path.isdir(args.workdir):
    check_directory(args.workdir)  # a file: says so
    raise UserError(
        f"--workdir {args.workdir}: no such directory (the --workdir of a training run)"
    )
  logging.getLogger().setLevel(logging.INFO)
  return args


def make_directory(path: str, flag: str = "--workdir") -> None:
  """`os.makedirs(path, exist_ok=True)`, with what stops it (a file in the way, no permission)
  as a UserError naming `flag`."""
  check_directory(path, flag)
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    raise UserError(f"{flag} {path}: cannot create it ({e.strerror})") from None


def check_output_file(path: str, flag: str = "--output") -> None:
  """A UserError unless a file can be written at `path`: its directory exists, and `path` is not
  a directory. Checked before the work whose result it receives."""
  if os.path.isdir(path):
    raise UserError(f"{flag} {path} is a directory; give a file name")
  directory = os.path.dirname(path) or "."
  if os.path.exists(directory) and not os.path.isdir(directory):
    raise UserError(f"{flag} {path}: {directory} is a file, not a directory")
  check_directory(directory, flag)  # a file further up
  if not os.path.isdir(directory):
    raise UserError(f"{flag} {path}: the directory {directory} does not exist")
  if not os.access(directory, os.W_OK):
    raise UserError(f"{flag} {path}: the directory {directory} is not writable")


def define_beam_stop_flag():
  """The decoding commands' --beam_stop flag (translate, parse): the run's eval.beam_stop."""
  flags.DEFINE_enum(
      "beam_stop",
      None,
      list(batch_shapes.STOPS),
      "When the beam search leaves a sentence (default: the run's eval.beam_stop, 'proven' unless "
      "set): 'proven', once no alive hypothesis can beat the best finished one (the result of "
      "searching to the output limit); 'k_finished', also once beam_size hypotheses have "
      "finished (CTranslate2's and fairseq's rule): faster, and a few translations differ.",
      module_name=sys.argv[0],
  )


def beam_stop_overrides(beam_stop: str | None) -> dict:
  """{"eval.beam_stop": beam_stop} where the flag was given, else {}."""
  return {} if beam_stop is None else {"eval.beam_stop": beam_stop}


def define_matmul_dtype_flag():
  """translate's --matmul_dtype flag: the run's eval.matmul_dtype."""
  flags.DEFINE_enum(
      "matmul_dtype",
      None,
      ["float32", "bfloat16"],
      "The layers' matmuls when decoding (default: the run's eval.matmul_dtype, the model's dtype "
      "unless set): bfloat16 rounds their inputs to bf16 and sums in float32, faster on CPUs with "
      "bf16 dot products; some outputs change (docs/translation.md).",
      module_name=sys.argv[0],
  )


def decoding_overrides(beam_stop: str | None, matmul_dtype: str | None) -> dict:
  """The eval settings translate's flags give ({} for flags not given)."""
  overrides = beam_stop_overrides(beam_stop)
  if matmul_dtype is not None:
    overrides["eval.matmul_dtype"] = matmul_dtype
  return overrides


def define_shapes_flag():
  """The decoding commands' --shapes flag (translate, parse): the run's eval.shapes overridden."""
  flags.DEFINE_enum(
      "shapes",
      None,
      list(batch_shapes.NAMES),
      "The search's batch shapes (batch_shapes.py; default: the run's eval.shapes, 'auto' "
      "unless set): 'fast' decodes fastest once compiled; 'few' compiles ~5x fewer programs, "
      "so a first call on a new machine returns ~2x sooner, decoding at ~0.8 of the speed; "
      f"'auto' takes 'few' for a call of fewer than {batch_shapes.AUTO_FEW_BELOW:,} sentences "
      "(translate: a --chunk_lines chunk; parse: the input), 'fast' from the first larger one on. "
      "The same translations (on a GPU, all but a few near-ties).",
      module_name=sys.argv[0],
  )


def define_batch_tokens_flag():
  """The decoding commands' --batch_tokens flag (translate, parse): the run's eval.batch_tokens
  overridden."""
  flags.DEFINE_integer(
      "batch_tokens",
      None,
      "Source tokens per decoding batch (rows = batch_tokens // padded length); default: the "
      "run's eval.batch_tokens.",
      module_name=sys.argv[0],
  )


def check_batch_tokens(value: int | None) -> None:
  if value is not None and value < 1:
    raise UserError(f"--batch_tokens={value}: must be >= 1")


def define_compilation_cache_flag():
  """The decoding commands' --compilation_cache flag (translate, parse; compilation.py), as the
  program's own: absl's --help lists the flags of the module named sys.argv[0]."""
  flags.DEFINE_string(
      "compilation_cache",
      None,
      "JAX's persistent compilation cache directory, where compiled searches are kept for later "
      "calls, with the searches' programs exported beside it (saved_programs.py) (default: "
      "$JAX_COMPILATION_CACHE_DIR, else ~/.cache/transformer_jax/jax_cache); empty to turn both "
      "off.",
      module_name=sys.argv[0],
  )


def read_lines(stream: Iterable[bytes], name: str) -> Iterator[str]:
  """The lines of a binary stream as text, without their line ends ("\\n" or "\\r\\n") and
  without a UTF-8 byte-order mark at the start of the stream (as editors on Windows save text),
  which would otherwise stay in the first word.

  A line that is not UTF-8 raises errors.UserError naming `name` and the line number.
  """
  for number, raw in enumerate(stream, start=1):
    if number == 1:
      raw = raw.removeprefix(codecs.BOM_UTF8)
    try:
      line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
      raise UserError(
          f"{name} line {number} is not valid UTF-8 (byte {raw[e.start]:#04x} at column "
          f"{e.start + 1}: {e.reason}); convert the input to UTF-8, e.g. with iconv"
      ) from None
    yield line.rstrip("\n").rstrip("\r")
