"""A search's programs kept as exported StableHLO (`jax.export`), so a later process skips tracing.

A warm `translate` (every program already in JAX's persistent compilation cache) spends a third
of its time tracing and lowering the search's ~30 programs again: JAX's cache keys a program by
its lowered text, so a process must first trace the Flax model and the search to find it
(~0.2 s a block, ~0.6 s a start, on the 2-vCPU VM). With `SavedPrograms`, the first process
exports each program it runs (`jax.export.export`: the StableHLO of exactly what it traced),
writes it to a file beside that cache and runs the exported program; a later process reads the
file and runs the same exported program, whose compiled code the cache already holds: nothing
of the model or the search is traced again.

A file is named by a digest of everything its text depends on: the program's name, its static
arguments and its arguments' tree, shapes, dtypes and shardings; the caller's `identity` (the
model config, the output limit, a constraint's tables: `predictor_identity`); the
source of this package; the versions of jax, jaxlib, flax, numpy and ml_dtypes; the platform and
devices. A change to any of them gives another name, so a stale program is never run. A file
that cannot be read back (truncated, from another serialization version) is written again.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import logging
import os
import pathlib
from collections.abc import Callable

import jax
import numpy as np

from transformer_jax import decode, files

SUBDIR = "transformer_jax_programs"  # inside the compilation cache directory
SUFFIX = ".jaxexport"
PACKAGES = ("jax", "jaxlib", "flax", "numpy", "ml_dtypes")

# The search's NamedTuples cross the exported programs' boundary: their trees must serialize.
for _cls in (decode.SearchCarry, decode.GreedyState, decode.BeamState):
  jax.export.register_namedtuple_serialization(
      _cls, serialized_name=f"transformer_jax.decode.{_cls.__name__}"
  )


@functools.cache
def source_digest() -> str:
  """sha256 of this package's Python source: any code change makes every program new."""
  digest = hashlib.sha256()
  root = pathlib.Path(__file__).parent
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

  def program(self, name: str, fn: Callable, static: dict) -> Callable:
    """`fn` bound to `static` as a callable (*args) -> outputs, run as an exported program."""
    return functools.partial(self._call, name, fn, static)

  def _call(self, name: str, fn: Callable, static: dict, *args):
    key = f"{name} {sorted(static.items())} {arguments_key(args)}"
    if key not in self._programs:  # the file's digest only for a program not yet run here
      digest = hashlib.sha256((self.prefix + key).encode()).hexdigest()
      exported = self._load(digest) or self._export(digest, functools.partial(fn, **static), args)
      self._programs[key] = jax.jit(exported.call)
    return self._programs[key](*args)

  def _path(self, digest: str) -> str:
    return os.path.join(self.directory, digest + SUFFIX)

  def _load(self, digest: str) -> jax.export.Exported | None:
    try:
      with open(self._path(digest), "rb") as f:
        data = f.read()
    except FileNotFoundError:
      return None
    except OSError as e:  # unreadable: exported again, and written if the directory allows
      logging.warning("saved program %s unreadable (%s): exporting it again", self._path(digest), e)
      return None
    try:
      exported = jax.export.deserialize(bytearray(data))
    except Exception as e:  # noqa: BLE001 - any unreadable file is written again
      logging.warning("saved program %s unreadable (%s): exporting it again", self._path(digest), e)
      return None
    self.loaded += 1
    return exported

  def _export(self, digest: str, fn: Callable, args: tuple) -> jax.export.Exported:
    exported = jax.export.export(jax.jit(fn))(*args)
    data = exported.serialize()

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


def predictor_identity(predictor: decode.Predictor) -> str | None:
  """What a Predictor's programs depend on besides their arguments and this package's code: the
  model config, the output limit and the constraint's tables (a dataclass of arrays and
  settings, as tree_constraint.TreeConstraint); None for another kind of constraint, which
  cannot be keyed."""
  constraint = predictor.constraint
  if constraint is None:
    described = "none"
  elif dataclasses.is_dataclass(constraint):
    described = [
        (f.name, _describe(getattr(constraint, f.name))) for f in dataclasses.fields(constraint)
    ]
  else:
    return None
  return f"{predictor.config!r} extra={predictor.max_decode_extra} constraint={described}"


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
  return predictor.saved
