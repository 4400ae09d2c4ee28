"""Decoding speed of a trained run: greedy and beam search on the same sentences, one JSON line.

  python benchmarks/decode.py --workdir DIR [--input FILE] [--beam_size 4] [--repeats 3]
      [--batch_tokens 2048] [--shapes fast] [--block 16] [--num_buckets 8]
      [--engines jax,ctranslate2] [--threads N] [--beam_stops proven,k_finished]
      [--matmul_dtypes bfloat16]

Default input: the run's test split (e.g. Multi30k test2016 for configs/multi30k.py). The run is
loaded once (parameters only, inference.py) with the search's `--shapes` (default `fast`, the
speed once compiled, whatever the run's eval.shapes); each mode is timed `--repeats` times after a
warm-up pass that compiles every batch shape (`compile_s`, warm-up included). Per mode the JSON
has the median sentences/s and output tokens/s (target tokens incl. EOS, counted on the
hypotheses), the decoder steps run (summed over batches) and the time per step, the batches and
their rows, and `row_steps` (sentences decoded at each step, summed: finished sentences leave a
batch). The beam is timed once per `--beam_stops` rule (eval.beam_stop; "beam4" is "proven",
"beam4_k_finished" stops once k hypotheses finished, as CTranslate2 does), with how many of its
translations are identical to the proven beam's; where greedy search refills its rows
(eval.refill, decoding/refill.py), "greedy_batches" times it in batches, with how many of its
translations are identical to "greedy"'s; with `--matmul_dtypes bfloat16` (eval.matmul_dtype),
"greedy_bfloat16" and "beam4_bfloat16" (and "beam4_k_finished_bfloat16" with that rule), with how
many of their translations are identical to "greedy"'s and "beam4"'s; beside them the device,
the batch size in tokens, the programs compiled and the peak memory (host RSS, and the device's
peak where it reports one).

`--engines jax,ctranslate2` also exports the same parameters to CTranslate2
(transformer_jax/serving/ctranslate2_model.py) once per `--quantizations` type and times its
`translate_batch` on the same sentences, batched by the same number of source tokens, greedy and
beam, a median of `--repeats` after a warm-up pass: under "ctranslate2", per type, sentences/s,
output tokens/s and how many translations are identical to the project's. It runs on `--ct2_device`
(default: CUDA when JAX runs on a GPU, else the CPU), on a CPU with `--threads` intra-op threads
(default: the cores this process may use); pin the process (`taskset -c 0-1 python
benchmarks/decode.py ...`) to give both engines the same cores. CTranslate2's beam search divides
log P(Y) by |Y|^`--length_penalty` where the project's divides by the §6.1 GNMT ((5 + |Y|) / 6)^α
(|Y| with EOS in both), so their beam translations differ a little."""

import dataclasses
import json
import os
import pathlib
import resource
import statistics
import sys
import tempfile
import time

from absl import app, flags

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from anywhere

from benchmarks import machine, sentences  # noqa: E402
from transformer_jax import cli
from transformer_jax.decoding import batch_shapes

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
_SHAPES = flags.DEFINE_enum(
    "shapes",
    "fast",
    list(batch_shapes.NAMES),
    "The search's batch shapes (batch_shapes.py; not the run's eval.shapes): the default 'fast' "
    "is the speed once compiled.",
)
_BLOCK = flags.DEFINE_integer(
    "block", None, "Cache length block of --shapes fast or few (default: theirs; 0: none)."
)
_NUM_BUCKETS = flags.DEFINE_integer(
    "num_buckets",
    None,
    "Source lengths batches are padded to (default: the run's data.num_buckets, at most 8; "
    "pipeline.eval_bucket_lengths): each is a search compiled.",
)
_BEAM_STOPS = flags.DEFINE_list(
    "beam_stops",
    ["proven"],
    "The beam's stop rules to time, each a mode (eval.beam_stop: "
    f"{', '.join(batch_shapes.STOPS)}).",
)
_ENGINES = flags.DEFINE_list(
    "engines", ["jax"], "Engines to time: jax, ctranslate2 (serving/ctranslate2_model.py)."
)
_QUANTIZATIONS = flags.DEFINE_list(
    "quantizations",
    ["float32", "int8"],
    "CTranslate2 weight types to time (serving/ctranslate2_model.py).",
)
_THREADS = flags.DEFINE_integer(
    "threads", None, "CTranslate2's intra-op threads (default: the cores this process may use)."
)
_CT2_DEVICE = flags.DEFINE_enum(
    "ct2_device",
    "auto",
    ["auto", "cpu", "cuda"],
    "CTranslate2's device; auto: cuda when JAX runs on a GPU (and CTranslate2 sees one), else cpu.",
)
_LENGTH_PENALTY = flags.DEFINE_float(
    "length_penalty", 1.0, "CTranslate2's beam length penalty: log P(Y) / |Y|^length_penalty."
)
_COMPARE_BATCHES = flags.DEFINE_bool(
    "compare_batches",
    True,
    "Where greedy search refills its rows (eval.refill, one CPU device), also time it in "
    "batches (mode greedy_batches, eval.refill=off) in the same run.",
)
_REFILL = flags.DEFINE_enum(
    "refill",
    None,
    ["auto", "on", "off"],
    "Greedy search in refilled rows (eval.refill; default: the run's, 'auto': on AMD CPUs).",
)
_MATMUL_DTYPES = flags.DEFINE_list(
    "matmul_dtypes",
    [],
    "Also time greedy and the beam with the layers' matmuls in each of these dtypes "
    "(eval.matmul_dtype, e.g. bfloat16): modes greedy_DTYPE and beamK_DTYPE (beamK_STOP_DTYPE "
    "for each other --beam_stops rule), with how many translations are identical to greedy's "
    "and the proven beam's.",
)
ENGINES = ("jax", "ctranslate2")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if _BLOCK.value is not None and _SHAPES.value == "auto":
    raise app.UsageError("--block applies to --shapes fast or few, not auto")
  for stop in _BEAM_STOPS.value:
    if stop not in batch_shapes.STOPS:
      raise app.UsageError(f"--beam_stops: {stop!r} is not one of {batch_shapes.STOPS}")
  for dtype in _MATMUL_DTYPES.value:
    if dtype not in ("float32", "bfloat16"):
      raise app.UsageError(f"--matmul_dtypes: {dtype!r} is not float32 or bfloat16")
  engines, ct2_device = _check_engines()
  import jax

  from transformer_jax.data import pipeline
  from transformer_jax.runs import inference

  overrides = {"eval.refill": _REFILL.value} if _REFILL.value else None
  run = inference.load_run(
      _WORKDIR.value, _CHECKPOINT.value, shapes=_SHAPES.value, overrides=overrides
  )
  if _NUM_BUCKETS.value is not None:
    run.config.data.num_buckets = _NUM_BUCKETS.value
  if _BLOCK.value is not None:
    shapes = batch_shapes.SHAPES[_SHAPES.value]
    run.predictor.shapes = dataclasses.replace(shapes, block=_BLOCK.value or None)
  sources = sentences.source_ids(run, _WORKDIR.value, _INPUT.value)
  batch_tokens = _BATCH_TOKENS.value or inference.DEFAULT_BATCH_TOKENS
  device = jax.devices()[0]
  result = {
      "workdir": _WORKDIR.value,
      "device": device.device_kind,
      **machine.describe(),
      "platform": device.platform,
      "devices": jax.device_count(),
      "checkpoint": run.checkpoint,
      "alpha": run.alpha,
      "batch_tokens": batch_tokens,
      "shapes": _SHAPES.value,
      "block": run.predictor.shapes_for(len(sources)).block,
      "bucket_lengths": list(pipeline.eval_bucket_lengths(run.config.data)),
  }
  beam = f"beam{_BEAM.value}"
  modes = (("greedy", 1), (beam, _BEAM.value))  # CTranslate2's, and ours with each stop rule
  # Each mode's overrides of the run's eval settings: greedy (refilled rows, where the search
  # refills: decoding/refill.py) and, to compare, in batches; the beam under each stop rule.
  variants = {"greedy": {}}
  if _COMPARE_BATCHES.value and run.predictor.refills(1, run.mesh):
    variants["greedy_batches"] = {"eval.refill": "off"}
  for stop in _BEAM_STOPS.value:
    variants[_mode(beam, stop)] = {} if stop == "proven" else {"eval.beam_stop": stop}
  for dtype in _MATMUL_DTYPES.value:  # greedy and the beam under each stop rule, in `dtype`
    variants[f"greedy_{dtype}"] = {"eval.matmul_dtype": dtype}
    for stop in _BEAM_STOPS.value:
      mode = _mode(beam, stop)
      variants[f"{mode}_{dtype}"] = {**variants[mode], "eval.matmul_dtype": dtype}
  translations = {}  # mode -> the project's translations, to compare CTranslate2's with
  predictors = []  # each variant's search: its programs are its own
  for name, overrides in variants.items() if "jax" in engines else ():
    decoder = run.with_overrides(overrides) if overrides else run
    predictors += [decoder.predictor] if decoder.predictor not in predictors else []
    greedy = name.startswith("greedy")
    kwargs = {"beam_size": 1 if greedy else _BEAM.value, "batch_tokens": batch_tokens}
    start = time.perf_counter()
    hypotheses = decoder.decode_ids(sources, **kwargs)  # warm-up: compiles each batch shape
    translations[name] = hypotheses
    compile_s = time.perf_counter() - start
    out_tokens = sum(len(run.tokenizer.encode(h)) + 1 for h in hypotheses)
    times, stats = [], {}
    for _ in range(_REPEATS.value):
      start = time.perf_counter()
      decoder.decode_ids(sources, stats=stats, **kwargs)
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
    first = "greedy" if greedy else beam  # the mode this one is compared with
    if name != first and first in translations:
      same = sum(a == b for a, b in zip(hypotheses, translations[first]))
      result[name]["identical_to_greedy" if greedy else "identical_to_proven"] = same
  if "jax" in engines:
    result["programs_compiled"] = sum(p.programs() for p in predictors)
    for name in variants:
      if not name.startswith("greedy"):
        ratio = result[name]["seconds"] / result["greedy"]["seconds"]
        result[f"{name}_over_greedy_time"] = round(ratio, 2)
  if "ctranslate2" in engines:
    result["ctranslate2"] = _time_ctranslate2(
        run, sources, modes, batch_tokens, translations, ct2_device
    )
  result["peak_rss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
  memory = getattr(device, "memory_stats", lambda: None)() or {}
  if "peak_bytes_in_use" in memory:
    result["device_peak_gib"] = round(memory["peak_bytes_in_use"] / 2**30, 2)
  print(json.dumps(result))


def _mode(name: str, stop: str) -> str:
  """A mode's name under a beam stop rule: "beam4" (proven), "beam4_k_finished"."""
  return name if stop == "proven" else f"{name}_{stop}"


def _check_engines() -> tuple[list[str], str | None]:
  """The engines asked for, and CTranslate2's device (None without it): bad values refused here,
  before the run is loaded."""
  from transformer_jax.serving import ctranslate2_model

  engines = _ENGINES.value
  unknown = [e for e in engines if e not in ENGINES]
  if unknown or not engines:
    raise ctranslate2_model.ExportError(
        f"--engines={','.join(engines)}: expected some of {ENGINES}"
    )
  ct2_device = None
  if "ctranslate2" in engines:
    for quantization in _QUANTIZATIONS.value:
      ctranslate2_model.check_quantization(quantization)
    ct2_device = _ct2_device(ctranslate2_model.import_ctranslate2())
  if _THREADS.value is not None and _THREADS.value < 1:
    raise ctranslate2_model.ExportError(f"--threads={_THREADS.value}: must be >= 1")
  return engines, ct2_device


def _ct2_device(ctranslate2) -> str:
  """--ct2_device resolved: with auto, the JAX backend's kind of device (a GPU: cuda)."""
  import jax

  from transformer_jax.serving import ctranslate2_model

  device = _CT2_DEVICE.value
  cuda_devices = ctranslate2.get_cuda_device_count()
  if device == "auto":
    device = "cuda" if jax.default_backend() == "gpu" and cuda_devices else "cpu"
  if device == "cuda" and not cuda_devices:
    raise ctranslate2_model.ExportError("--ct2_device=cuda: CTranslate2 sees no CUDA device")
  return device


def _time_ctranslate2(run, sources, modes, batch_tokens, translations, device) -> dict:
  """CTranslate2 on the run's parameters, exported once per quantization: for each mode, the
  median of --repeats passes over `sources` after a warm-up pass, and how many translations are
  identical to the project's (`translations`, where timed)."""
  import ctranslate2

  from transformer_jax.serving import ctranslate2_model

  threads = _THREADS.value or len(os.sched_getaffinity(0))
  vocab_path = ctranslate2_model.workdir_vocabulary(_WORKDIR.value)
  tokens = ctranslate2_model.vocabulary_tokens(vocab_path)
  index = {token: i for i, token in enumerate(tokens)}
  unk, pad, bos = (ctranslate2_model.SPECIAL_TOKENS[name] for name in ("unk", "pad", "bos"))
  source_tokens = [[tokens[i] for i in ids] for ids in sources]
  cfg = run.config
  # decode.py stops each sentence at its own limit (ctranslate2_model.output_limit).
  # CTranslate2 takes one
  # limit per call: it decodes to the longest sentence's limit, and each output is cut at its
  # own, which gives the project's greedy outputs exactly (a beam's may differ).
  extra, max_len = cfg.eval.max_decode_extra, run.model_config.max_len
  limits = [ctranslate2_model.output_limit(len(ids), extra, max_len) for ids in sources]
  max_length = max(limits)
  out = {"device": device, "threads": threads, "length_penalty": _LENGTH_PENALTY.value}
  with tempfile.TemporaryDirectory() as directory:
    for quantization in _QUANTIZATIONS.value:
      path = os.path.join(directory, quantization)
      ctranslate2_model.export_ctranslate2(
          run.model_config, run.params, vocab_path, path, quantization
      )
      translator = ctranslate2.Translator(
          path, device=device, inter_threads=1, intra_threads=threads
      )
      out[quantization] = {"compute_type": translator.compute_type}
      for name, beam in modes:
        kwargs = {
            "beam_size": beam, "length_penalty": _LENGTH_PENALTY.value,
            "max_batch_size": batch_tokens, "batch_type": "tokens",
            "max_decoding_length": max_length, "min_decoding_length": 0,
            "suppress_sequences": [[pad[1]], [bos[1]]],  # never emitted by decode.py either
        }  # fmt: skip
        results = translator.translate_batch(source_tokens, **kwargs)  # warm-up
        hypotheses = [
            run.tokenizer.decode([index.get(t, unk[0]) for t in r.hypotheses[0][:limit]])
            for r, limit in zip(results, limits)
        ]
        times = []
        for _ in range(_REPEATS.value):
          start = time.perf_counter()
          translator.translate_batch(source_tokens, **kwargs)
          times.append(time.perf_counter() - start)
        seconds = statistics.median(times)
        out_tokens = sum(len(run.tokenizer.encode(h)) + 1 for h in hypotheses)  # as above
        out[quantization][name] = {
            "sentences": len(sources),
            "seconds": round(seconds, 3),
            "times": [round(t, 3) for t in times],
            "sentences_per_s": round(len(sources) / seconds, 2),
            "tokens_per_s": round(out_tokens / seconds, 1),
        }
        for stop in batch_shapes.STOPS:  # the same mode of the project's, under each rule
          ours = _mode(name, stop)
          if ours in translations:
            same = sum(a == b for a, b in zip(hypotheses, translations[ours]))
            key = "identical_to_jax" + ours[len(name) :]
            out[quantization][name][key] = same
      del translator
  return out


if __name__ == "__main__":
  cli.run(main)
