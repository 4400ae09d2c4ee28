"""Decoding speed of a trained run: greedy and beam search on the same sentences, one JSON line.

  python benchmarks/decode.py --workdir DIR [--input FILE] [--beam_size 4] [--repeats 3]

Default input: the run's test split (e.g. Multi30k test2016 for configs/multi30k.py). Each mode
is timed `--repeats` times after a warm-up pass that compiles every length bucket; the JSON has
the median sentences/s and output tokens/s (target tokens incl. EOS, counted on the hypotheses).
"""

import json
import pathlib
import statistics
import sys
import time

from absl import app, flags

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from anywhere

_WORKDIR = flags.DEFINE_string("workdir", None, "A training run's --workdir.", required=True)
_INPUT = flags.DEFINE_string("input", None, "Source sentences, one per line (default: test split).")
_CHECKPOINT = flags.DEFINE_string(
    "checkpoint", "auto", "A step number, 'latest', 'avg' or 'auto' (see translate.load_run)."
)
_BEAM = flags.DEFINE_integer("beam_size", 4, "Beam size for the beam-search measurement.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed passes per mode (the median is reported).")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  import jax

  from transformer_jax import translate
  from transformer_jax.data import pipeline

  result = {"workdir": _WORKDIR.value, "device": jax.devices()[0].device_kind}
  for name, beam in (("greedy", 1), (f"beam{_BEAM.value}", _BEAM.value)):
    run = translate.load_run(_WORKDIR.value, _CHECKPOINT.value, beam_size=beam)
    if _INPUT.value:
      lines = pathlib.Path(_INPUT.value).read_text(encoding="utf-8").splitlines()
    else:
      dataset = pipeline.load_dataset(run.config, _WORKDIR.value)  # reuses the run's vocabulary
      lines = [src for src, _ in dataset.splits["test"].pairs]
    hypotheses = translate.translate_lines(run, lines)  # warm-up: compiles each bucket
    out_tokens = sum(len(run.tokenizer.encode(h)) + 1 for h in hypotheses)
    times = []
    for _ in range(_REPEATS.value):
      start = time.perf_counter()
      translate.translate_lines(run, lines)
      times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    result[name] = {
        "sentences": len(lines),
        "seconds": round(seconds, 3),
        "sentences_per_s": round(len(lines) / seconds, 2),
        "tokens_per_s": round(out_tokens / seconds, 1),
    }
  result["beam_over_greedy_time"] = round(
      result[f"beam{_BEAM.value}"]["seconds"] / result["greedy"]["seconds"], 2
  )
  print(json.dumps(result))


if __name__ == "__main__":
  app.run(main)
