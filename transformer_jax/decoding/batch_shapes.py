"""The batch shapes of `decode.Predictor` (each distinct one is a program to compile), and the
names of its beam's stop rules.

Plain Python (no JAX), so that the commands' flags and the config's validation can name them
without importing JAX.
"""

from __future__ import annotations

import dataclasses

# Cache lengths grow in blocks of this many positions: measured on the Multi30k model, see
# benchmarks/decode.py.
DEFAULT_BLOCK = 16


@dataclasses.dataclass(frozen=True)
class Shapes:
  """Which batch shapes `Predictor` decodes in, each a compiled program: the self-attention cache
  grows in blocks of `block` positions (None: one block), and a batch whose sentences are mostly
  done goes on in rows / shrink^j rows (at least `min_rows`)."""

  block: int | None = DEFAULT_BLOCK
  shrink: int = 2
  min_rows: int = 8

  def smaller(self, rows: int, active: int, multiple: int) -> int:
    """The rows to go on with: rows / shrink^j for the largest j that keeps the `active`
    sentences and `min_rows`, rounded up to a multiple of `multiple` (the devices the batch is
    split over); `rows` itself while more than that. Few shapes, so few programs compiled."""
    best = rows
    for j in range(1, 32):
      size = -(-rows // self.shrink**j)
      size = -(-size // multiple) * multiple
      if size < max(active, self.min_rows) or size >= best:
        break
      best = size
    return best


# `eval.shapes` and `--shapes`: "fast" decodes fastest once compiled; "few" compiles ~5x fewer
# programs, so a first call returns ~2x sooner, decoding at ~0.8 of the speed (beam 4, 2 CPU
# cores), with the same translations (on a GPU all but near-ties: 995 of 1,000 on an H200).
# "auto" (the default): "few" for a call of fewer than AUTO_FEW_BELOW sentences (a test set),
# "fast" from the first larger call on. On the Multi30k model (beam 4, 2 CPU cores) "few" takes
# less time in all below ~17,000 sentences in a first call and below ~1,800 in a later one
# (programs cached); on an H200 it was quicker at 1,000 in both. docs/experiments.md, "a first
# call in few programs" and "the batch shapes chosen by the call's size".
SHAPES = {"fast": Shapes(), "few": Shapes(block=48, shrink=4, min_rows=32)}
NAMES = ("auto", *SHAPES)
AUTO_FEW_BELOW = 2_000


def cache_block_ends(max_decode_len: int, block: int | None) -> tuple[int, ...]:
  """The cache lengths a search decodes in: multiples of `block`, then `max_decode_len` (None:
  one block). Steps p < ends[0] run with a cache of ends[0] positions, and so on."""
  if block is None or block >= max_decode_len:
    return (max_decode_len,)
  if block < 1:
    raise ValueError(f"block={block} must be >= 1")
  return tuple(range(block, max_decode_len, block)) + (max_decode_len,)


# Whether greedy search refills its rows (eval.refill, refill.py): "auto" on the CPUs of the
# vendors where it measured faster than batches (AMD EPYC; slower on an Intel Xeon with AMX:
# docs/benchmarks.md); "on" and "off" everywhere.
REFILLS = ("auto", "on", "off")
REFILL_FASTER_ON = ("AuthenticAMD",)


def cpu_vendor() -> str:
  """The host CPU's vendor id (/proc/cpuinfo's), or "" where it cannot be read."""
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      for line in f:
        if line.startswith("vendor_id"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return ""


def refills(setting: str) -> bool:
  """Whether eval.refill `setting` turns refilled rows on for this host."""
  return setting == "on" or (setting == "auto" and cpu_vendor() in REFILL_FASTER_ON)


# When a beam search's sentence is done (decode.py `Beam.done`): "proven" (no alive hypothesis can
# beat the best finished one), or also once k hypotheses have finished ("k_finished").
STOPS = ("proven", "k_finished")
