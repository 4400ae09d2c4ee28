"""XLA compiler flags from the config (`config.xla_flags`), set before JAX creates its backends.

XLA reads the XLA_FLAGS environment variable once, when JAX first creates a backend (the first
`jax.devices()` or computation), so `apply` must run before that: `train.run`, `translate` and
the benchmarks call it first. A flag already in XLA_FLAGS (set by the user) wins over the
config's value for the same flag.

The default, `--xla_gpu_enable_triton_gemm=false`, makes XLA on GPU call cuBLAS for every matmul
instead of generating some with Triton (why, measured with `benchmarks/throughput.py`:
docs/experiments.md). `xla_gpu_*` flags are accepted and
ignored on CPU and TPU.
"""

from __future__ import annotations

import os
import re

_FLAG = re.compile(r"--([A-Za-z0-9_]+)(=\S*)?")


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
  returns the flags added (none on a second call: they are set by then).

  XLA reads the variable once, when JAX creates its first backend, so this takes effect only
  before that; the commands call it before any JAX computation. Called later, it changes the
  variable but nothing in the running backend (JAX has no public way to ask whether a backend
  exists yet).
  """
  current_flags = os.environ.get("XLA_FLAGS", "")
  current = _names_set(current_flags)
  added = [token for name, token in parse(flags) if name not in current]
  if added:
    os.environ["XLA_FLAGS"] = " ".join([current_flags, *added]).strip()
  return added
