"""parallel/host_memory.py: freed buffers larger than glibc's mmap threshold are reused, not
mapped afresh (and page-faulted again) on every allocation; the user's GLIBC_TUNABLES wins."""

import os
import platform
import subprocess
import sys

import pytest

pytestmark = [
    pytest.mark.subprocess,  # a fresh process: malloc's settings are the process's
    pytest.mark.skipif(
        platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only"
    ),
]

# In a fresh process: reuse_freed_memory(), then 100 MB malloc'd, written and freed three times on
# the main thread and three times on a worker thread, as XLA's CPU runtime does with a step's
# temporaries. Prints whether it applied and the page faults of the last two rounds on each thread
# (the first round maps the memory whatever the setting).
_PROBE = """
import ctypes, resource, threading
from transformer_jax.parallel import host_memory
applied = host_memory.reuse_freed_memory()
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
SIZE = 100 << 20
faults = []
def rounds():
  for i in range(3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    p = libc.malloc(SIZE)
    ctypes.memset(p, 1, SIZE)
    libc.free(p)
    if i:
      faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
rounds()
worker = threading.Thread(target=rounds)
worker.start(); worker.join()
print(applied, *faults)
"""

PAGES = (100 << 20) // 4096  # a round that maps afresh faults once per 4 KiB page


def _probe(env_update: dict) -> tuple[bool, list[int]]:
  env = {
      k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "JAX_PLATFORMS")
  } | env_update
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = subprocess.run(
      [sys.executable, "-c", _PROBE], env=env, cwd=repo, capture_output=True, text=True, check=True
  ).stdout.split()
  return out[0] == "True", [int(n) for n in out[1:]]


def test_freed_buffers_are_reused_on_every_thread():
  applied, faults = _probe({"JAX_PLATFORMS": "cpu"})
  assert applied
  assert len(faults) == 4 and max(faults) < PAGES // 10, faults


def test_left_alone_where_jax_computes_on_an_accelerator():
  applied, faults = _probe({"JAX_PLATFORMS": "cuda,cpu"})
  assert not applied
  assert min(faults) > PAGES // 2, faults


def test_glibc_default_maps_afresh_and_the_users_tunables_win():
  # Any glibc.malloc tunable in the environment: reuse_freed_memory leaves malloc as it is, and
  # glibc's default then maps (and faults) the 100 MB again on every round.
  applied, faults = _probe({"JAX_PLATFORMS": "cpu", "GLIBC_TUNABLES": "glibc.malloc.check=0"})
  assert not applied
  assert min(faults) > PAGES // 2, faults
