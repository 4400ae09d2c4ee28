"""JAX's persistent compilation cache for the commands, and a count of what a process compiled.

A command that decodes compiles one program per batch shape and cache length (decode.py). JAX
keeps compiled programs on disk when `jax_compilation_cache_dir` is set: a later process with
the same programs loads them instead of compiling them. `enable_cache` turns it on for a
command: in the directory its flag names, else the one the user set for JAX itself
(`JAX_COMPILATION_CACHE_DIR`), else `default_cache_dir()`. `CompileLog` counts, through
`jax.monitoring`, the programs a process compiled and those it loaded from that cache.
"""

from __future__ import annotations

import collections
import os

import jax

ENV = "JAX_COMPILATION_CACHE_DIR"  # read by JAX itself at import
# jax.monitoring events: one per program built (compiled, or loaded from the persistent cache),
# one per load from that cache, and one per function traced (named by `fun_name`).
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
CACHE_HIT = "/jax/compilation_cache/cache_hits"
TRACE = "/jax/core/compile/jaxpr_trace_duration"


def default_cache_dir() -> str:
  """$XDG_CACHE_HOME (or ~/.cache)/transformer_jax/jax_cache: shared by every run, and
  writable even where a workdir is not."""
  root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(root, "transformer_jax", "jax_cache")


def enable_cache(directory: str | None = None) -> str | None:
  """Turns on JAX's persistent compilation cache; returns the directory in use (None: off).

  `directory` None: the user's `JAX_COMPILATION_CACHE_DIR`, else `default_cache_dir()`; "":
  off. Every program is kept, however quick it was to compile: a search's many small programs
  are what a warm start saves.
  """
  if directory is None:
    directory = os.environ.get(ENV) or default_cache_dir()
  if not directory:
    jax.config.update("jax_enable_compilation_cache", False)
    return None
  jax.config.update("jax_enable_compilation_cache", True)
  jax.config.update("jax_compilation_cache_dir", directory)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  return directory


class CompileLog:
  """Counts what JAX builds while it is open: `programs` (compiled or loaded), `loaded` (from
  the persistent cache), and `traces` per traced function's name."""

  def __init__(self):
    self.programs = self.loaded = 0
    self.traces: collections.Counter[str] = collections.Counter()

  @property
  def compiled(self) -> int:
    return self.programs - self.loaded

  def _duration(self, event: str, duration: float, **kwargs):
    del duration
    if event == BACKEND_COMPILE:
      self.programs += 1
    elif event == TRACE:
      self.traces[kwargs.get("fun_name", "")] += 1

  def _event(self, event: str, **kwargs):
    del kwargs
    if event == CACHE_HIT:
      self.loaded += 1

  def __enter__(self) -> CompileLog:
    jax.monitoring.register_event_duration_secs_listener(self._duration)
    jax.monitoring.register_event_listener(self._event)
    return self

  def __exit__(self, *exc):
    jax.monitoring.unregister_event_duration_listener(self._duration)
    jax.monitoring.unregister_event_listener(self._event)


def summary(log: CompileLog, cache: str | None, saved) -> str:
  """One line for stderr: the programs a command compiled, loaded and read back exported."""
  exported = f"; {saved.loaded} read exported, {saved.exported} exported" if saved else ""
  return (
      f"programs: {log.loaded} loaded from the compilation cache ({cache or 'off'}), "
      f"{log.compiled} compiled{exported}"
  )
