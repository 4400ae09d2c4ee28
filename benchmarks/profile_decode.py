"""Where a warm decoding pass spends its time on the CPU, by operation: one JSON line.

  python benchmarks/profile_decode.py --workdir DIR [--beam_size 4] [--batch_tokens 2048]
      [--input FILE] [--limit N]

The run is loaded once (`--shapes fast`), its test split (or `--input`) decoded once to compile
every program, then once more under JAX's profiler with XLA:CPU's per-operation trace events on
(`--xla_cpu_enable_xprof_traceme`). Each event is an XLA instruction of the search's programs; its
JAX source op (the `op_name` of the optimized HLO, dumped with `--xla_dump_to`) says which part of
the model or the search it is. The time of the events is summed per part:

  encoder             the encoder's pass (once per sentence)
  cache               writing the KV cache and reading its slots (kv_cache.py)
  layer_norm          LayerNorm and the residual additions fused with it
  log_softmax         the normalization of the logits
  output_projection   the decoder's logits over the vocabulary (§3.4's shared matrix) and what XLA
                      fused into them
  self_attention_projections, cross_attention_projections   Q, K, V and output projections
  self_attention_over_cache, cross_attention_over_source    scores, softmax, weighted sums
  ffn                 §3.3's position-wise feed-forward networks
  decoder_other       the rest of the decoder (embedding lookup, positions)
  search              top-k, argmax, gathers and the search's bookkeeping (decode.py, top_k.py)
  other               the rest (fused pieces named by no JAX op)

and the JSON gives, beside each part's seconds and share, the pass's wall time, the decoder steps
and rows decoded, and the matmul FLOPs a decoder step needs per row (`step_flops_per_row`: the
layers' projections and FFN and the output projection; attention over the cache is not counted),
with the FLOP rate the pass achieved on them, to hold against benchmarks/throughput.py's measured
matmul peak. Events overlap where XLA runs two on its two threads: shares are of the summed event
time, not of the wall time. One process, one pass: a profile, not a speed measurement
(benchmarks/decode.py measures speed).
"""

import collections
import glob
import gzip
import json
import os
import pathlib
import re
import sys
import tempfile
import time

from absl import app, flags

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from anywhere

from benchmarks import flops, machine, sentences  # noqa: E402

_WORKDIR = flags.DEFINE_string("workdir", None, "A translation run's --workdir.", required=True)
_INPUT = flags.DEFINE_string("input", None, "Source sentences, one per line (default: test split).")
_BEAM = flags.DEFINE_integer("beam_size", 4, "Beam size (1: greedy).", lower_bound=1)
_BATCH_TOKENS = flags.DEFINE_integer("batch_tokens", 2048, "Source tokens per batch.")
_LIMIT = flags.DEFINE_integer("limit", 0, "Decode only the first N sentences (0: all).")

# Parts of a step, by the first pattern its op_name matches (order matters: a layer norm or a
# cache write is named inside its attention block).
PARTS = (
    ("encoder", r"Transformer\.encode|/encoder/"),
    ("cache", r"kv_cache"),
    ("layer_norm", r"_block/norm/|final_norm"),
    ("log_softmax", r"log_softmax|logsumexp"),
    ("output_projection", r"shared_embedding|->btv"),
    ("self_attention_projections", r"self_attention\._(project|output_projection)"),
    ("self_attention_over_cache", r"self_attention\."),
    ("cross_attention_projections", r"cross_attention\._(project|output_projection)"),
    ("cross_attention_over_source", r"cross_attention\."),
    ("ffn", r"/ffn"),
    ("decoder_other", r"Transformer\.decode"),
    ("search", r"jit\(_(block|start|run|refill|keep|empty)_impl\)"),
)


def _instruction_ops(dump_dir: str) -> dict[tuple[str, str], str]:
  """(HLO module name, instruction name) -> its JAX op_name, from every optimized module XLA
  dumped. Different programs name their instructions alike (`fusion.1`), so the module is part
  of the key; modules of one name (one function at other shapes) share their instructions. An
  instruction XLA made without a source op (a batched dot of attention taken out of its
  fusion) is given the op of its first operand that has one."""
  ops, unnamed = {}, {}
  line_re = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = \S+ [\w\-]+\(([^)]*)\)(.*)$")
  for path in glob.glob(os.path.join(dump_dir, "*after_optimizations.txt")):
    module = re.sub(r"^module_\d+\.|\.[^.]*after_optimizations\.txt$", "", os.path.basename(path))
    for line in pathlib.Path(path).read_text().splitlines():
      m = line_re.match(line)
      if not m:
        continue
      op_name = re.search(r'op_name="([^"]*)"', m.group(3))
      if op_name:
        ops.setdefault((module, m.group(1)), op_name.group(1))
      else:
        operands = re.findall(r"%([\w.\-]+)", m.group(2))
        unnamed.setdefault((module, m.group(1)), operands)
  for (module, name), operands in unnamed.items():
    named = [ops[(module, o)] for o in operands if (module, o) in ops]
    if named and (module, name) not in ops:
      ops[(module, name)] = named[0]
  return ops


def _events(trace_dir: str) -> list[dict]:
  """The complete ('X') events of the trace the profiler wrote. It writes the same events twice
  (perfetto_trace.json.gz and HOST.trace.json.gz): one file is read."""
  paths = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
  paths = paths or glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
  if not paths:
    return []
  with gzip.open(paths[0], "rt") as f:
    data = json.load(f)
  items = data["traceEvents"] if isinstance(data, dict) else data
  return [e for e in items if e.get("ph") == "X" and "dur" in e]


def part_of(op_name: str) -> str:
  for name, pattern in PARTS:
    if re.search(pattern, op_name):
      return name
  return "other"


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  dump_dir = tempfile.mkdtemp(prefix="profile_decode_hlo_")
  os.environ["XLA_FLAGS"] = " ".join(
      filter(
          None,
          [
              os.environ.get("XLA_FLAGS", ""),
              "--xla_cpu_enable_xprof_traceme=true",
              f"--xla_dump_to={dump_dir}",
              "--xla_dump_hlo_as_text",
          ],
      )
  )
  import jax

  from transformer_jax.runs import inference

  run = inference.load_run(_WORKDIR.value, shapes="fast")
  sources = sentences.source_ids(run, _WORKDIR.value, _INPUT.value, _LIMIT.value)
  kwargs = {"beam_size": _BEAM.value, "batch_tokens": _BATCH_TOKENS.value}
  run.decode_ids(sources, **kwargs)  # compiles every program (and dumps its HLO)
  trace_dir = tempfile.mkdtemp(prefix="profile_decode_trace_")
  stats = {}
  with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
    start = time.perf_counter()
    run.decode_ids(sources, stats=stats, **kwargs)
    wall = time.perf_counter() - start
  ops = _instruction_ops(dump_dir)
  seconds = collections.Counter()
  for event in _events(trace_dir):
    key = (event.get("args", {}).get("hlo_module"), event["name"])
    if key in ops:
      seconds[part_of(ops[key])] += event["dur"] / 1e6
  total = sum(seconds.values())
  flops_row = flops.step_flops_per_row(run.model_config)
  print(
      json.dumps(
          {
              "workdir": _WORKDIR.value,
              "device": jax.devices()[0].device_kind,
              **machine.describe(),
              "beam_size": _BEAM.value,
              "sentences": len(sources),
              "wall_s": round(wall, 3),
              "event_s": round(total, 3),
              "steps": stats["steps"],
              "row_steps": stats["row_steps"],
              "step_ms": round(1000 * wall / max(stats["steps"], 1), 2),
              "step_flops_per_row": flops_row,
              "decoder_matmul_gflops_per_s": round(
                  flops_row * stats["row_steps"] * _BEAM.value / wall / 1e9, 1
              ),
              "parts_s": {k: round(v, 3) for k, v in seconds.most_common()},
              "parts_share": {k: round(v / max(total, 1e-9), 3) for k, v in seconds.most_common()},
          }
      )
  )


if __name__ == "__main__":
  app.run(main)
