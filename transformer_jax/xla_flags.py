"""XLA compiler flags from the config (`config.xla_flags`), set before JAX creates its backends.

XLA reads the XLA_FLAGS environment variable once, when JAX first creates a backend (the first
`jax.devices()` or computation), so `apply` must run before that: `train.run` and the benchmarks
call it first. Afterwards it changes nothing, and says so. A flag already in XLA_FLAGS (set by
the user) wins over the config's value for the same flag.

The default, `--xla_gpu_enable_triton_gemm=false`, makes XLA on GPU call cuBLAS for every matmul
instead of generating some with Triton: on an H100 that made the base and big train steps faster
(`benchmarks/throughput.py`; figures in docs/experiments.md). `xla_gpu_*` flags are accepted and
ignored on CPU and TPU.
"""

from __future__ import annotations

import logging
import os
import re

_FLAG = re.compile(r"--([A-Za-z0-9_]+)(=\S*)?")
_warned: set[str] = set()  # flags already reported as too late, once per process


def parse(flags: str) -> list[tuple[str, str]]:
  """[(name, "--name=value"), ...] for a space-separated flag string; ValueError names a token
  that is not a `--name` or `--name=value` flag."""
  parsed = []
  for token in flags.split():
    match = _FLAG.fullmatch(token)
    if not match:
      raise ValueError(f"{token!r} is not an XLA flag of the form --name=value")
    parsed.append((match.group(1), token))
  return parsed


def _names_set(xla_flags_env: str) -> set[str]:
  """Flag names in an XLA_FLAGS value, read leniently (it is the user's, not validated here)."""
  return set(re.findall(r"(?:^|\s)--?([A-Za-z0-9_]+)", xla_flags_env))


def apply(flags: str) -> list[str]:
  """Appends to XLA_FLAGS each flag of `flags` whose name XLA_FLAGS does not already set;
  returns the flags added. Does nothing (and warns) once JAX's backends exist."""
  current_flags = os.environ.get("XLA_FLAGS", "")
  current = _names_set(current_flags)
  added = [token for name, token in parse(flags) if name not in current]
  if not added:
    return []
  from jax._src import xla_bridge  # private, but the only way to ask without creating one

  # Should a JAX release drop the private query, set the variable anyway: harmless if too late.
  started = getattr(xla_bridge, "backends_are_initialized", lambda: False)
  if started():
    unreported = [token for token in added if token not in _warned]
    if unreported:
      _warned.update(unreported)
      logging.warning(
          "config.xla_flags %s not applied: JAX's backends already exist (XLA reads XLA_FLAGS "
          "when the first one is created); set XLA_FLAGS before the first JAX computation",
          unreported,
      )
    return []
  os.environ["XLA_FLAGS"] = " ".join([current_flags, *added]).strip()
  return added
