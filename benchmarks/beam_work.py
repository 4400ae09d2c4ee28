"""The least work a beam search must do on a run's sentences, per stop rule: one JSON line.

  python benchmarks/beam_work.py --workdir DIR [--input FILE] [--beam_size 4]
      [--batch_tokens 2048] [--limit N]

Each sentence is searched with `search.Beam` (the run's α and output limits, the §6.1 beam the
`Predictor` runs, in the batches `inference.decode_batches` makes) one step at a time, and after
every step the host reads which sentences are done under each stop rule (eval.beam_stop:
`proven`, the default, and `k_finished`, CTranslate2's and fairseq's). A sentence leaves at once
when done, so these are the fewest steps any batching can run (the `Predictor` drops finished
sentences between blocks; its `row_steps` are more). Per rule: the sentence-steps after the first
(BOS) step, the hypothesis-steps (beam_size rows each), and under `proven` the `live`
hypothesis-steps, those whose hypothesis could still beat the sentence's best finished one
(`Beam.done`'s bound); the others could be skipped without changing a translation.

Their matmul FLOPs (flops.py: the decoder's per row-step, one BOS row per sentence, the source
tokens' encoder and cross-attention keys and values; attention not counted) over the output
projection's GEMM rate measured here (`[beam_size * 64, d_model] x [d_model, vocab]`, jitted,
the fastest of 7 calls; the fastest of the search's matmul shapes on the CPU VM) give
`matmul_bound_s`: a lower bound on the search's time on this machine, to hold against
benchmarks/decode.py's times (its CTranslate2 beam, for one). A count of work, not a speed
measurement of the search.
"""

import json
import pathlib
import sys
import time

from absl import app, flags

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from anywhere

from benchmarks import flops, machine, sentences  # noqa: E402

_WORKDIR = flags.DEFINE_string("workdir", None, "A translation run's --workdir.", required=True)
_INPUT = flags.DEFINE_string("input", None, "Source sentences, one per line (default: test split).")
_BEAM = flags.DEFINE_integer("beam_size", 4, "Beam size.", lower_bound=2)
_BATCH_TOKENS = flags.DEFINE_integer("batch_tokens", 2048, "Source tokens per batch.")
_LIMIT = flags.DEFINE_integer("limit", 0, "Search only the first N sentences (0: all).")
GEMM_ROWS_PER_BEAM = 64  # the GEMM timed: beam_size * 64 rows, as a batch of 64 sentences


def gemm_gflops(rows: int, d_model: int, vocab: int, repeats: int = 7) -> float:
  """GFLOP/s of `[rows, d_model] x [d_model, vocab]` in float32, jitted, 20 per call: the fastest
  call's (a bound on time takes the best rate; a loaded VM only lowers it)."""
  import jax
  import jax.numpy as jnp

  x = jax.random.normal(jax.random.PRNGKey(0), (rows, d_model), jnp.float32)
  w = jax.random.normal(jax.random.PRNGKey(1), (d_model, vocab), jnp.float32) * 0.05

  @jax.jit
  def twenty(x, w):  # each product feeds the next, so none is skipped
    return jax.lax.fori_loop(0, 20, lambda _, h: h + (h @ w)[:, :d_model] * 1e-6, x)

  jax.block_until_ready(twenty(x, w))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(twenty(x, w))
    times.append(time.perf_counter() - start)
  return 20 * 2 * rows * d_model * vocab / min(times) / 1e9


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  import jax
  import jax.numpy as jnp
  import numpy as np

  from transformer_jax.data import pipeline
  from transformer_jax.decoding import batch_shapes, search
  from transformer_jax.runs import inference

  run = inference.load_run(_WORKDIR.value, shapes="fast")
  sources = sentences.source_ids(run, _WORKDIR.value, _INPUT.value, _LIMIT.value)
  k, alpha = _BEAM.value, jnp.float32(run.alpha)
  decoder, extra = run.predictor.decoder, run.predictor.max_decode_extra
  rules = {stop: search.Beam(k, best_only=True, stop=stop) for stop in batch_shapes.STOPS}
  proven = rules["proven"]
  sentence_steps = dict.fromkeys(rules, 0)
  live = 0
  buckets = pipeline.eval_bucket_lengths(run.config.data)
  for index, inputs in inference.decode_batches(sources, buckets, _BATCH_TOKENS.value):
    real = index >= 0  # [b]: a sentence, not a filler row
    n = min(inputs.shape[1] + extra, run.model_config.max_len)
    log_probs, beams, sentence = decoder.start(run.params, inputs, n)
    state = proven.init(log_probs, search.output_limits(inputs, extra, n), n, alpha)
    beams = decoder.widen(beams, k)
    model = search.Stepper(decoder.step_fn(run.params, inputs, sentence), decoder.follow)
    step = jax.jit(lambda state, beams: proven.step(model, state, beams, alpha))  # noqa: B023
    while True:
      done = {stop: np.asarray(rule.done(state, alpha)) | ~real for stop, rule in rules.items()}
      if done["proven"].all():
        break
      for stop in rules:
        sentence_steps[stop] += int((~done[stop]).sum())
      could_win = np.asarray(proven.best_scores(state, alpha) > state.finished_scores[:, :1])
      live += int((could_win & ~done["proven"][:, None]).sum())
      state, beams = step(state, beams)
  cfg = run.model_config
  row_flops, token_flops = flops.step_flops_per_row(cfg), flops.source_flops_per_token(cfg)
  source_tokens = sum(len(ids) + 1 for ids in sources)  # EOS included, padding not
  source_gflop = (source_tokens * token_flops + len(sources) * row_flops) / 1e9
  rate = gemm_gflops(k * GEMM_ROWS_PER_BEAM, cfg.d_model, cfg.vocab_size)
  result = {
      "workdir": _WORKDIR.value,
      "device": jax.devices()[0].device_kind,
      **machine.describe(),
      "beam_size": k,
      "alpha": run.alpha,
      "sentences": len(sources),
      "source_tokens": source_tokens,
      "gemm_gflops_per_s": round(rate, 1),
  }
  for stop in rules:
    hypothesis_steps = k * sentence_steps[stop]
    gflop = source_gflop + hypothesis_steps * row_flops / 1e9
    result[stop] = {
        "sentence_steps": sentence_steps[stop],
        "hypothesis_steps": hypothesis_steps,
        "matmul_gflop": round(gflop, 1),
        "matmul_bound_s": round(gflop / rate, 3),
    }
  result["proven"]["live_hypothesis_steps"] = live
  print(json.dumps(result))


if __name__ == "__main__":
  app.run(main)
