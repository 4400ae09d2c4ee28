"""Host memory that XLA's CPU backend frees is kept for its next step, not handed back to Linux.

XLA's CPU runtime takes each step's temporaries from malloc and frees them when the step ends.
glibc serves a request above its mmap threshold (which its dynamic rule never raises past 32 MiB)
with a fresh `mmap` and returns it with `munmap` on free, so a buffer of that size costs the
kernel a page fault and a zeroed page for every 4 KiB of it, on every step: the Multi30k recipe's
logits alone are 2,048 tokens x 8,000 pieces x 4 bytes = 65 MB, several times per step (forward,
softmax, gradient). Worker threads also get arenas of their own, which cannot hold a chunk larger
than 64 MiB and so mmap it whatever the threshold. `reuse_freed_memory` sets glibc's mmap and trim
thresholds to 1 GiB and keeps one arena, so freed buffers stay in the heap and the next step
reuses them: same results (allocation does not change what is computed), less time in the kernel
(docs/experiments.md, 2026-12-04). The price is that the process keeps its peak heap.

Called by `cli.run` before a command's main, so before JAX starts its threads. It does nothing off
glibc (macOS, musl), when GLIBC_TUNABLES already sets any `glibc.malloc.*` tunable (the user's own
malloc settings win, as a flag in XLA_FLAGS wins over the config's: xla_flags.py), and where JAX
will compute on an accelerator (JAX_PLATFORMS naming another platform first, or a GPU or TPU
plugin installed): there the step's buffers live on the device, and one arena for every host
thread (an input pipeline's among them) was not measured.
"""

from __future__ import annotations

import ctypes
import os
import pkgutil
import platform

# mallopt(3) parameters, from glibc's <malloc.h>.
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8

# Above any single buffer of the models here; mallopt takes an int, so below 2 GiB.
THRESHOLD_BYTES = 1 << 30


# Top-level modules of JAX's accelerator plugins (jax[cuda12], jax[cuda13], jax[rocm], jax[tpu]).
ACCELERATOR_PLUGIN_PREFIXES = ("jax_cuda", "jax_rocm", "libtpu")


def computes_on_cpu() -> bool:
  """Whether JAX will compute on the CPU, told without importing JAX: JAX_PLATFORMS names the CPU
  first, or it is unset and no accelerator plugin is installed."""
  platforms = os.environ.get("JAX_PLATFORMS", "").strip()
  if platforms:
    return platforms.split(",")[0].strip() == "cpu"
  return not any(
      module.name.startswith(ACCELERATOR_PLUGIN_PREFIXES) for module in pkgutil.iter_modules()
  )


def reuse_freed_memory() -> bool:
  """Sets glibc's malloc to keep freed memory (module docstring); True if it did."""
  if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
    return False
  if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", "") or not computes_on_cpu():
    return False
  mallopt = ctypes.CDLL(None).mallopt  # the process's own libc
  mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
  settings = ((M_MMAP_THRESHOLD, THRESHOLD_BYTES), (M_TRIM_THRESHOLD, THRESHOLD_BYTES),
              (M_ARENA_MAX, 1))  # fmt: skip
  return all([mallopt(option, value) == 1 for option, value in settings])
