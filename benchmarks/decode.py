"""Decoding speed of a trained run: greedy and beam search on the same sentences, one JSON line.

  python benchmarks/decode.py --workdir DIR [--input FILE] [--beam_size 4] [--repeats 3]
      [--batch_tokens 2048] [--block 16]

Default input: the run's test split (e.g. Multi30k test2016 for configs/multi30k.py). The run is
loaded once (parameters only, inference.py); each mode is timed `--repeats` times after a
warm-up pass that compiles every batch shape (`compile_s`, warm-up included). Per mode the JSON
has the median sentences/s and output tokens/s (target tokens incl. EOS, counted on the
hypotheses), the decoder steps run (summed over batches) and the time per step, the batches and
their rows, and `row_steps` (sentences decoded at each step, summed: finished sentences leave a
batch); beside them the device, the batch size in tokens, the programs compiled and the peak
memory (host RSS, and the device's peak where it reports one).
"""

import json
import pathlib
import resource
import statistics
import sys
import time

from absl import app, flags

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from anywhere

from transformer_jax import cli

_WORKDIR = flags.DEFINE_string("workdir", None, "A training run's --workdir.", required=True)
_INPUT = flags.DEFINE_string("input", None, "Source sentences, one per line (default: test split).")
_CHECKPOINT = flags.DEFINE_string(
    "checkpoint", "auto", "A step number, 'latest', 'avg' or 'auto' (see inference.load_run)."
)
_BEAM = flags.DEFINE_integer("beam_size", 4, "Beam size for the beam-search measurement.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed passes per mode (the median is reported).")
_BATCH_TOKENS = flags.DEFINE_integer(
    "batch_tokens", None, "Source tokens per batch (default: inference.DEFAULT_BATCH_TOKENS)."
)
_BLOCK = flags.DEFINE_integer(
    "block", None, "Cache length block of the search (default: decode.DEFAULT_BLOCK; 0: none)."
)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  import jax

  from transformer_jax import decode, inference
  from transformer_jax.data import pipeline

  run = inference.load_run(_WORKDIR.value, _CHECKPOINT.value)
  if _BLOCK.value is not None:
    run.predictor = decode.Predictor(
        run.model_config, run.config.eval.max_decode_extra, block=_BLOCK.value or None
    )
  if _INPUT.value:
    lines = pathlib.Path(_INPUT.value).read_text(encoding="utf-8").splitlines()
  else:
    dataset = pipeline.load_dataset(run.config, _WORKDIR.value)  # reuses the run's vocabulary
    lines = [src for src, _ in dataset.splits["test"].pairs]
  sources = [ids for ids in run.encode_lines(lines) if ids is not None]
  batch_tokens = _BATCH_TOKENS.value or inference.DEFAULT_BATCH_TOKENS
  device = jax.devices()[0]
  result = {
      "workdir": _WORKDIR.value,
      "device": device.device_kind,
      "platform": device.platform,
      "devices": jax.device_count(),
      "checkpoint": run.checkpoint,
      "alpha": run.alpha,
      "batch_tokens": batch_tokens,
      "block": run.predictor.block,
  }
  for name, beam in (("greedy", 1), (f"beam{_BEAM.value}", _BEAM.value)):
    kwargs = {"beam_size": beam, "batch_tokens": batch_tokens}
    start = time.perf_counter()
    hypotheses = run.translate_ids(sources, **kwargs)  # warm-up: compiles each batch shape
    compile_s = time.perf_counter() - start
    out_tokens = sum(len(run.tokenizer.encode(h)) + 1 for h in hypotheses)
    times, stats = [], {}
    for _ in range(_REPEATS.value):
      start = time.perf_counter()
      run.translate_ids(sources, stats=stats, **kwargs)
      times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    result[name] = {
        "sentences": len(sources),
        "seconds": round(seconds, 3),
        "times": [round(t, 3) for t in times],
        "sentences_per_s": round(len(sources) / seconds, 2),
        "tokens_per_s": round(out_tokens / seconds, 1),
        "warmup_s": round(compile_s, 1),
        "batches": stats["batches"],
        "rows": stats["rows"],
        "steps": stats["steps"],
        "step_ms": round(1000 * seconds / max(stats["steps"], 1), 2),
        "row_steps": stats["row_steps"],
    }
  result["programs_compiled"] = run.predictor.programs()
  result["beam_over_greedy_time"] = round(
      result[f"beam{_BEAM.value}"]["seconds"] / result["greedy"]["seconds"], 2
  )
  result["peak_rss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
  memory = getattr(device, "memory_stats", lambda: None)() or {}
  if "peak_bytes_in_use" in memory:
    result["device_peak_gib"] = round(memory["peak_bytes_in_use"] / 2**30, 2)
  print(json.dumps(result))


if __name__ == "__main__":
  cli.run(main)
