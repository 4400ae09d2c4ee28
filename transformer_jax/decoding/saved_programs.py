"""A search's programs kept as exported StableHLO (`jax.export`), so a later process skips tracing.

A warm `translate` (every program already in JAX's persistent compilation cache) would still
trace and lower the search's programs again: JAX's cache keys a program by its lowered text, so
a process must first trace the Flax model and the search to find it (what that costs:
docs/experiments.md). With `SavedPrograms`, the first process
exports each program it runs (`jax.export.export`: the StableHLO of exactly what it traced),
writes it to a file beside that cache and runs the exported program; a later process reads the
file and runs the same exported program, whose compiled code the cache already holds: nothing
of the model or the search is traced again.

A file is named by a digest of everything its text depends on: the program's name, its static
arguments and its arguments' tree, shapes, dtypes and shardings; the caller's `identity` (the
model config, the output limit, a constraint's tables: `predictor_identity`); the
source of this package; the versions of jax, jaxlib, flax, numpy and ml_dtypes; the platform and
devices. A change to any of them gives another name, so a stale program is never run.

Each file is a header line (`FORMAT`: this module's format and the sha256 of the payload) and
the payload, `jax.export`'s serialization; it is written whole (a temporary file renamed into
place), so two processes sharing a cache never read half a file. A file is checked before it
is used: one whose header or digest does not match (bytes overwritten, truncated, written by
another format version), that `jax.export` cannot deserialize, or whose program fails when first
called is set aside as `NAME.unreadable` with a one-line warning naming it, then traced,
exported and written again; the call's outputs are those of a clean cache. A directory that
cannot be written (read-only, full) costs a later call its tracing, nothing else.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import inspect
import logging
import os
import pathlib
from collections.abc import Callable

import jax
import numpy as np

from transformer_jax import files
from transformer_jax.decoding import decode, kv_cache, refill, search

SUBDIR = "transformer_jax_programs"  # inside the compilation cache directory
SUFFIX = ".jaxexport"
SET_ASIDE = ".unreadable"  # a file that failed its check is renamed NAME + SET_ASIDE
FORMAT = b"transformer_jax saved program v2 sha256="  # header: FORMAT, 64 hex digits, newline
PACKAGES = ("jax", "jaxlib", "flax", "numpy", "ml_dtypes")

# The search's NamedTuples cross the exported programs' boundary: their trees must serialize.
for _cls in (
    decode.SearchCarry,
    search.GreedyState,
    search.BeamState,
    refill.RefillCarry,
    kv_cache.SelfKV,
    kv_cache.SourceKV,
):
  jax.export.register_namedtuple_serialization(
      _cls, serialized_name=f"{_cls.__module__}.{_cls.__name__}"
  )


@functools.cache
def source_digest() -> str:
  """sha256 of this package's Python source: any code change makes every program new."""
  digest = hashlib.sha256()
  root = pathlib.Path(__file__).parents[1]  # the package: decoding/ is one of its folders
  for path in sorted(root.rglob("*.py")):
    digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
  return digest.hexdigest()


def environment() -> str:
  """The versions, platform and devices a program's text and its compiled code depend on."""
  versions = [f"{name}={importlib.metadata.version(name)}" for name in PACKAGES]
  devices = jax.devices()
  return f"{versions} {jax.default_backend()} {len(devices)}x{devices[0].device_kind}"


def arguments_key(args: tuple) -> str:
  """The tree, shapes, dtypes and shardings of `args` (what the program was exported for)."""
  leaves, tree = jax.tree.flatten(args)
  described = [
      (np.shape(x), np.result_type(x).name, str(getattr(x, "sharding", "host"))) for x in leaves
  ]
  return f"{tree} {described}"


class SavedPrograms:
  """Runs programs through their exported form, kept in `directory` (module docstring)."""

  def __init__(self, directory: str, identity: str):
    self.directory = directory
    self.prefix = f"{identity}\n{source_digest()}\n{environment()}\n"
    self.exported = self.loaded = 0  # files written / read by this process
    self._programs: dict[str, Callable] = {}

  def program(
      self, name: str, fn: Callable, static: dict, donate: tuple[int, ...] = ()
  ) -> Callable:
    """`fn` bound to `static` as a callable (*args) -> outputs, run as an exported program; the
    arguments `donate` (indices) are donated to it, as to a jitted one."""
    return functools.partial(self._call, name, fn, static, donate)

  def _call(self, name: str, fn: Callable, static: dict, donate: tuple[int, ...], *args):
    key = f"{name} {sorted(static.items())} {arguments_key(args)}"
    program = self._programs.get(key)
    if program is not None:
      return program(*args)
    # The file's digest only for a program not yet run here.
    digest = hashlib.sha256((self.prefix + key).encode()).hexdigest()
    traced = functools.partial(fn, **static)
    exported = self._load(digest)
    if exported is not None:
      try:  # a file that passed its checks can still hold a program XLA cannot read or run
        # Compiled before the call: the arguments it would take (donate) are not yet taken.
        program = jax.jit(exported.call, donate_argnums=donate).lower(*args).compile()
        outputs = jax.block_until_ready(program(*args))  # its errors here, not later
      except Exception as e:  # noqa: BLE001 - any failure of a loaded program: exported again
        self.loaded -= 1
        self._set_aside(digest, f"its program failed when first called: {_first_line(e)}")
        if any(x.is_deleted() for x in jax.tree.leaves(args) if isinstance(x, jax.Array)):
          raise  # it failed running, after it took its donated arguments: nothing to retry
      else:
        self._programs[key] = program
        return outputs
    program = jax.jit(self._export(digest, traced, args).call, donate_argnums=donate)
    self._programs[key] = program
    return program(*args)

  def _path(self, digest: str) -> str:
    return os.path.join(self.directory, digest + SUFFIX)

  def _load(self, digest: str) -> jax.export.Exported | None:
    """The exported program kept under `digest`, or None: no file, or one that failed its
    checks (then set aside)."""
    try:
      with open(self._path(digest), "rb") as f:
        data = f.read()
    except FileNotFoundError:
      return None
    except OSError as e:  # unreadable: exported again, and written if the directory allows
      self._set_aside(digest, f"it cannot be read ({e.strerror})")
      return None
    payload, problem = unpack(data)
    if problem:
      self._set_aside(digest, problem)
      return None
    try:
      exported = jax.export.deserialize(bytearray(payload))
    except Exception as e:  # noqa: BLE001 - jax.export raises many kinds on a bad file
      self._set_aside(digest, f"jax.export cannot deserialize it: {_first_line(e)}")
      return None
    self.loaded += 1
    return exported

  def _set_aside(self, digest: str, problem: str) -> None:
    """Moves a damaged file out of the way (when the directory allows) with one warning line."""
    path = self._path(digest)
    try:
      os.replace(path, path + SET_ASIDE)
      where = f"set aside as {os.path.basename(path)}{SET_ASIDE}"
    except OSError as e:
      where = f"left in place ({e.strerror})"
    logging.warning(
        "saved program %s unreadable (%s): %s, exporting it again", path, problem, where
    )

  def _export(self, digest: str, fn: Callable, args: tuple) -> jax.export.Exported:
    exported = jax.export.export(jax.jit(fn))(*args)
    data = pack(exported.serialize())

    def write(tmp: str):
      with open(tmp, "wb") as f:
        f.write(data)

    try:
      os.makedirs(self.directory, exist_ok=True)
      files.atomic_write(self._path(digest), write)
    except OSError as e:  # a full or read-only disk costs the next call its tracing, no more
      logging.warning("could not keep the exported program %s: %s", self._path(digest), e)
      return exported
    self.exported += 1
    return exported


def pack(payload: bytes) -> bytes:
  """A saved program's file: the header (FORMAT, the payload's sha256 in hex, a newline), then
  the payload."""
  return FORMAT + hashlib.sha256(payload).hexdigest().encode() + b"\n" + bytes(payload)


def unpack(data: bytes) -> tuple[bytes, str | None]:
  """(payload, None) for a file that `pack` wrote and nothing changed since; else (b"", what is
  wrong with it)."""
  header_end = len(FORMAT) + 64
  if len(data) <= header_end and FORMAT.startswith(data[: len(FORMAT)]):
    return b"", "truncated header"
  if not data.startswith(FORMAT) or data[header_end : header_end + 1] != b"\n":
    return b"", "not a file of this format (another version, or a damaged header)"
  expected, payload = (
      data[len(FORMAT) : header_end].decode("ascii", "replace"),
      data[header_end + 1 :],
  )
  if hashlib.sha256(payload).hexdigest() != expected:
    return b"", "its bytes do not match their sha256 (overwritten or truncated)"
  return payload, None


def _first_line(error: BaseException) -> str:
  lines = str(error).strip().splitlines()
  return f"{type(error).__name__}: {lines[0] if lines else ''}"[:200]


def predictor_identity(predictor: decode.Predictor) -> str | None:
  """What a Predictor's programs depend on besides their arguments and this package's code: the
  model config, the output limit, the beam's stop rule and the constraint's tables (a dataclass
  of arrays and settings, as tasks' constraints are); None for another kind of constraint, which
  cannot be keyed, and for what a task decodes with in the place of the search (a span chart's
  parses: one jitted pass, kept by JAX's compilation cache alone)."""
  if not isinstance(predictor, decode.Predictor):
    return None
  constraint = predictor.constraint
  if constraint is None:
    described = "none"
  elif dataclasses.is_dataclass(constraint):
    described = [
        (f.name, _describe(getattr(constraint, f.name))) for f in dataclasses.fields(constraint)
    ]
  else:
    return None
  return (
      f"{model_sources(predictor)} {predictor.config!r} extra={predictor.max_decode_extra} "
      f"stop={predictor.stop} constraint={described}"
  )


def model_sources(predictor: decode.Predictor) -> str:
  """The classes of the predictor's model, its attention and its cache (and their bases), and a
  sha256 of the files that define them: a variant defined outside this package, then edited, is
  never served the program of its earlier source."""
  model = predictor.model
  classes = [type(model), getattr(model, "attention", None), predictor.decoder.cache]
  names, paths = [], set()
  for cls in classes:
    for c in inspect.getmro(cls) if isinstance(cls, type) else ():
      if c.__module__.split(".")[0] in ("builtins", "flax", "typing", "abc"):
        continue
      names.append(f"{c.__module__}.{c.__qualname__}")
      try:
        paths.add(inspect.getsourcefile(c))
      except TypeError:  # a class with no source file
        pass
  digest = hashlib.sha256()
  for path in sorted(p for p in paths if p):
    digest.update(path.encode() + b"\0" + pathlib.Path(path).read_bytes() + b"\0")
  return f"{sorted(set(names))}:{digest.hexdigest()}"


def _describe(value) -> str:
  if isinstance(value, np.ndarray):
    return f"{value.dtype}{value.shape}:{hashlib.sha256(value.tobytes()).hexdigest()}"
  return repr(value)


def attach(predictor: decode.Predictor, cache_dir: str | None) -> SavedPrograms | None:
  """Makes `predictor` run its programs exported and kept beside JAX's compilation cache
  `cache_dir`; returns them, or None (and leaves it as it is) without a cache directory, for one
  that is not on a local file system (gs://...: JAX's cache works there, these files are not
  written) or for a predictor that cannot be keyed."""
  identity = predictor_identity(predictor)
  if not cache_dir or identity is None or "://" in cache_dir:  # a bucket: JAX's cache alone
    return None
  predictor.saved = SavedPrograms(os.path.join(cache_dir, SUBDIR), identity)
  if predictor.refiller is not None:  # its programs are keyed by their names and arguments
    predictor.refiller.saved = predictor.saved
  return predictor.saved
