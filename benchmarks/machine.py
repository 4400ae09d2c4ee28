"""The machine a benchmark ran on, for its JSON line: the host processor by name, the vector
instruction sets it has that matmul libraries choose between, and the cores this process may
use. A CPU speed compares only with one measured on the same processor and cores, and a device's
kind does not name the processor ("cpu"); a VM may name it only "AMD EPYC"."""

import os
import platform

# The instruction sets oneDNN, XNNPACK and CTranslate2 pick kernels by, as /proc/cpuinfo names them.
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")


def _cpuinfo(key: str) -> str | None:
  """The first `key : value` of /proc/cpuinfo (Linux), or None."""
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      for line in f:
        if line.split(":", 1)[0].strip() == key:
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return None


def processor() -> str:
  """The host CPU's model name (/proc/cpuinfo on Linux), else what `platform` knows of it."""
  return _cpuinfo("model name") or platform.processor() or platform.machine()


def isa() -> list[str]:
  """Which of ISA_FLAGS the host CPU has (empty where /proc/cpuinfo is not there)."""
  flags = set((_cpuinfo("flags") or "").split())
  return [flag for flag in ISA_FLAGS if flag in flags]


def cpus() -> int:
  """The cores this process may run on (`taskset` narrows them)."""
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:  # not Linux
    return os.cpu_count() or 1


def describe() -> dict:
  return {"processor": processor(), "isa": isa(), "cpus": cpus()}
