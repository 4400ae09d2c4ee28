"""Where a first decoding call's time goes: tracing, lowering and compiling each search program.

  python benchmarks/compile.py --workdir DIR [--beam_size 4] [--shapes 128x16,64x32]
      [--layers N] [--repeats 3]

A first `translate` compiles one program per batch shape and cache length (decode.Predictor:
`start`, the encoder with the first block of steps, and `block`, the steps of a longer cache).
For each batch shape ROWSxLENGTH this times, on a fresh Predictor each repeat (nothing cached),
the `start` program and the `block` of the next cache length: Python tracing (Flax and the
search), lowering to StableHLO, and XLA's compilation, as wall seconds and as this process's CPU
seconds (CPU / wall > 1: XLA compiles on several threads). Then the same `start` programs
compiled one after the other against all at once from one thread per shape
(`compile_threads_s`). Medians of `--repeats`; one JSON line. `--layers N` times a model of N
encoder and N decoder layers (random parameters, the run's sizes otherwise): what a layer costs.
"""

import concurrent.futures
import functools
import json
import pathlib
import statistics
import sys
import time

from absl import app, flags

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from anywhere

from benchmarks import machine  # noqa: E402

_WORKDIR = flags.DEFINE_string("workdir", None, "A training run's --workdir.", required=True)
_BEAM = flags.DEFINE_integer("beam_size", 4, "Beam size of the programs (1: greedy).")
_SHAPES = flags.DEFINE_string("shapes", "128x16,64x32", "Batch shapes ROWSxLENGTH, comma-separated")
_LAYERS = flags.DEFINE_integer("layers", None, "Encoder and decoder layers (default: the run's).")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Repeats per figure (the median is reported).")


def _timed(fn):
  """(fn's result, wall seconds, this process's CPU seconds)."""
  wall, cpu = time.perf_counter(), time.process_time()
  out = fn()
  return out, time.perf_counter() - wall, time.process_time() - cpu


def main(argv):
  del argv
  import jax  # noqa: PLC0415  after absl has parsed the flags
  import jax.numpy as jnp  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  from transformer_jax.decoding import batch_shapes, decode  # noqa: PLC0415
  from transformer_jax.model.transformer import Transformer  # noqa: PLC0415
  from transformer_jax.runs import inference  # noqa: PLC0415

  run = inference.load_run(_WORKDIR.value)
  model_config, params = run.model_config, run.params
  if _LAYERS.value is not None:
    model_config = model_config.replace(num_layers=_LAYERS.value, num_decoder_layers=_LAYERS.value)
    tokens = jnp.ones((2, 8), jnp.int32)
    init = functools.partial(Transformer(model_config).init, jax.random.PRNGKey(0), tokens, tokens)
    params = jax.jit(init)()["params"]
  shapes = [tuple(int(x) for x in s.split("x")) for s in _SHAPES.value.split(",")]
  beam, alpha, exit_at = _BEAM.value, jnp.float32(0.6), np.int32(0)

  def predictor():
    return decode.Predictor(model_config, run.config.eval.max_decode_extra, beam, 0.6)

  def batch(rows, length):
    inputs = np.full((rows, length), 5, np.int32)
    inputs[:, -1] = 1  # EOS: every sentence as long as the bucket
    return inputs, min(length + run.config.eval.max_decode_extra, model_config.max_len)

  def compile_start(p, rows, length):
    inputs, n = batch(rows, length)
    ends = batch_shapes.cache_block_ends(n, batch_shapes.SHAPES[p.shapes].block)
    return p._start.trace(params, inputs, alpha, exit_at, beam_size=beam, n=n, end=ends[0])  # noqa: SLF001

  result = {"workdir": _WORKDIR.value, "device": jax.devices()[0].device_kind, "beam_size": beam}
  result.update(machine.describe())
  result["layers"] = model_config.num_layers

  def time_shape(rows, length) -> dict:
    """Seconds of each stage of the `start` program and of the next cache length's `block`."""
    p = predictor()
    inputs, n = batch(rows, length)
    ends = batch_shapes.cache_block_ends(n, batch_shapes.SHAPES[p.shapes].block)
    traced, t_s, _ = _timed(functools.partial(compile_start, p, rows, length))
    lowered, l_s, _ = _timed(traced.lower)
    start, c_s, c_c = _timed(lowered.compile)
    carry = start(params, inputs, alpha, exit_at)[0]
    block = functools.partial(
        p._block.trace,  # noqa: SLF001
        params, carry, alpha, exit_at, None, beam_size=beam, end=ends[min(1, len(ends) - 1)],
    )  # fmt: skip
    traced, bt_s, _ = _timed(block)
    lowered, bl_s, _ = _timed(traced.lower)
    _, bc_s, bc_c = _timed(lowered.compile)
    return {
        "start_trace_s": t_s, "start_lower_s": l_s, "start_compile_s": c_s,
        "start_compile_cpu_s": c_c, "block_trace_s": bt_s, "block_lower_s": bl_s,
        "block_compile_s": bc_s, "block_compile_cpu_s": bc_c,
    }  # fmt: skip

  with jax.set_mesh(run.mesh):
    for rows, length in shapes:
      repeats = [time_shape(rows, length) for _ in range(_REPEATS.value)]
      result[f"{rows}x{length}"] = {
          k: round(statistics.median(r[k] for r in repeats), 3) for k in repeats[0]
      }

    one, threads = [], []
    for _ in range(_REPEATS.value):
      p = predictor()
      _, seconds, _ = _timed(lambda p=p: [compile_start(p, *s).lower().compile() for s in shapes])
      one.append(seconds)
      p = predictor()
      mesh = run.mesh

      def work(shape, p=p, mesh=mesh):
        with jax.set_mesh(mesh):  # the mesh context is per thread
          return compile_start(p, *shape).lower().compile()

      with concurrent.futures.ThreadPoolExecutor(len(shapes)) as pool:
        _, seconds, _ = _timed(lambda pool=pool: list(pool.map(work, shapes)))
      threads.append(seconds)
    result["compile_one_thread_s"] = round(statistics.median(one), 3)
    result["compile_threads_s"] = round(statistics.median(threads), 3)
  print(json.dumps(result), flush=True)


if __name__ == "__main__":
  app.run(main)
