"""Training-step throughput and MFU: the compiled train step alone, no input pipeline.

Prints one JSON line: median step time over `--steps` timed steps (after `--warmup` steps, each
ended with block_until_ready), target tokens/s, achieved FLOP/s, and MFU twice: `mfu_nominal`
against the device's nominal dense peak from its data sheet (`NOMINAL_PEAKS`; null for a device
not listed there, e.g. a CPU), the figure MFU is usually quoted against, and `mfu` against a
matmul peak measured on the same devices in the same run and dtype (square `--peak_n` matmuls,
`--peak_chain` of them dispatched back to back per measurement, median), the timed steps and peak
measurements interleaved so both see the same load. Model configs apply `config.xla_flags` as
training does. All accelerator rows of docs/benchmarks.md: `bash benchmarks/accelerator.sh OUTDIR`.

  python benchmarks/throughput.py --config configs/quickstart.py \\
      --config.model.num_layers=3 --config.model.d_model=256 --config.model.num_heads=4 \\
      --config.model.d_ff=1024 --config.data.vocab_size=8000 --batch_size=64 --seq_len=32

With --batch_size and --seq_len the batch is synthetic: random tokens, no padding, source and
target both seq_len long, vocabulary config.data.vocab_size (nothing is read or tokenized).
Without them, the first training batch of the configured data is used, as training reads it
(packed rows with data.packing; loading not timed).

FLOPs (`flops_per_step`, used for MFU) are counted analytically, as matmul FLOPs only (2 per
multiply-add; the backward pass costs twice the forward, so training = 3x forward):

  forward = 2 * [ encoder:  N * B*S * (2 e (k+v) + 2 e f)        projections Q,K,V,O and FFN
                          + N * B*S^2 * (k+v)                     Q K^T and A V
                  decoder:  M * B*T * (2 e (k+v) + 2 e f)        self-attention proj. and FFN
                          + M * e (k+v) * (B*T + B*S)            cross-attention Q,O / K,V
                          + M * (B*T^2 + B*T*S) * (k+v)          self- and cross-attention
                  output:   B*T * e * V ]                         pre-softmax projection, V outputs
  per step = 3 * forward

i.e. 6 * (matmul parameters) * tokens plus the attention terms, with B rows, S/T source/target
length, e d_model, k = h d_k and v = h d_v (both e by default, §3.2.2), f d_ff, V vocabulary,
N/M encoder/decoder layers; padded positions and the
masked half of causal attention are counted, since the hardware computes them. Softmax, LayerNorm,
dropout, embedding gathers and Adam are not counted (they are not matmuls), nor is remat's
recomputation (MFU, not HFU). XLA's own count (`compiled.cost_analysis()`) is printed beside it as
`xla_flops_per_step` where the backend reports one; it is per device for a sharded program,
counts a loop body once (so it undercounts `model.scan_layers` models) and counts non-matmul
FLOPs too. A task's own model (tasks/base.py `Task.build_model`, e.g. the span chart) is not the
paper's Transformer: its MFU uses XLA's count, and `flops_count` says so.

--breakdown also times the forward pass alone and forward+backward (no optimizer update).
"""

import json
import pathlib
import statistics
import sys
import time

from absl import app, flags
from ml_collections import config_flags

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from anywhere

from benchmarks import machine  # noqa: E402
from transformer_jax import cli  # noqa: E402
from transformer_jax.errors import UserError  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/quickstart.py", "Experiment config file.", lock_config=True
)
_BATCH_SIZE = flags.DEFINE_integer(
    "batch_size", 0, "Synthetic batch rows (with --seq_len).", lower_bound=0
)
_SEQ_LEN = flags.DEFINE_integer("seq_len", 0, "Synthetic source/target length.", lower_bound=0)
_STEPS = flags.DEFINE_integer("steps", 10, "Timed steps (the median is reported).", lower_bound=1)
_WARMUP = flags.DEFINE_integer("warmup", 2, "Untimed steps after compilation.", lower_bound=0)
_PEAK_N = flags.DEFINE_integer(
    "peak_n", 0, "Peak matmul size (0: 2048 on CPU, 8192 elsewhere).", lower_bound=0
)
_PEAK_REPEATS = flags.DEFINE_integer(
    "peak_repeats", 10, "Timed peak measurements (median).", lower_bound=1
)
_PEAK_CHAIN = flags.DEFINE_integer(
    "peak_chain",
    0,
    "Matmuls dispatched back to back per measurement (0: 1 on CPU, else 10).",
    lower_bound=0,
)
_BREAKDOWN = flags.DEFINE_bool("breakdown", False, "Also time forward and forward+backward.")


def model_flops_per_step(cfg, batch: int, source_len: int, target_len: int) -> float:
  """Matmul FLOPs of one training step (forward + backward); see the module docstring."""
  B, S, T = batch, source_len, target_len
  e, f, V = cfg.d_model, cfg.d_ff, cfg.vocab_size
  N, M = cfg.num_layers, cfg.decoder_layers
  # h*d_k and h*d_v: both e unless the config sets d_k, d_v (Table 3 rows (A), (B)).
  k, v = cfg.num_heads * cfg.head_key_dim, cfg.num_heads * cfg.head_value_dim
  encoder = N * (B * S * (2 * e * (k + v) + 2 * e * f) + B * S * S * (k + v))
  decoder = M * (
      B * T * (2 * e * (k + v) + 2 * e * f)  # self-attention projections, FFN
      + e * (k + v) * B * T  # cross-attention Q and O, on target positions
      + e * (k + v) * B * S  # cross-attention K and V, on source positions
      + (B * T * T + B * T * S) * (k + v)  # scores and weighted sums, self and cross
  )
  output = B * T * e * V
  forward = 2 * (encoder + decoder + output)  # 2 FLOPs per multiply-add
  return 3.0 * forward  # backward = 2 x forward


# Nominal dense matmul peaks per device (vendors' data sheets), by dtype, for `mfu_nominal`: the
# figure MFU is usually quoted against (PaLM, nanoGPT, MaxText). float32 on NVIDIA GPUs is TF32,
# which XLA uses for float32 matmuls at JAX's default precision. Matched by the start of
# `device_kind`, longest first; an unknown device reports no nominal MFU.
NOMINAL_PEAKS = {
    "NVIDIA H100 80GB HBM3": {"bfloat16": 989.4e12, "float32": 494.7e12},  # SXM
    "NVIDIA H100 NVL": {"bfloat16": 835.5e12, "float32": 417.8e12},
    "NVIDIA H100 PCIe": {"bfloat16": 756.5e12, "float32": 378.0e12},
    "NVIDIA H200": {"bfloat16": 989.4e12, "float32": 494.7e12},  # SXM; the H100 SXM's compute
    "NVIDIA A100": {"bfloat16": 312e12, "float32": 156e12},
    "TPU v4": {"bfloat16": 275e12},
    "TPU v5 lite": {"bfloat16": 197e12},
    "TPU v5p": {"bfloat16": 459e12},
    "TPU v5": {"bfloat16": 459e12},
    "TPU v6 lite": {"bfloat16": 918e12},
}


def nominal_peak(device_kind: str, dtype: str) -> float | None:
  """Per-device nominal dense peak FLOP/s of `device_kind` in `dtype`, or None if unknown."""
  for name in sorted(NOMINAL_PEAKS, key=len, reverse=True):
    if device_kind.startswith(name):
      return NOMINAL_PEAKS[name].get(dtype)
  return None


def time_calls(fn, repeats: int) -> list[float]:
  import jax

  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return times


def peak_matmul(dtype, n: int, mesh, chain: int):
  """(call, flops): `chain` square n x n matmuls on every device of `mesh`, compiled, warmed up.

  The call dispatches the `chain` matmuls back to back and waits for the last only, so that a
  fast device's per-call dispatch and synchronisation (tens of microseconds against ~1.5 ms for
  an 8192^3 bf16 matmul on an H100) are hidden behind the matmuls before it, as they are behind
  the train step's own work. With chain 1 an H100's peak comes out at about half of what it
  sustains (docs/experiments.md), which would double every MFU.
  """
  import jax
  from jax.sharding import NamedSharding, PartitionSpec

  devices = mesh.devices.size
  key_a, key_b = jax.random.split(jax.random.PRNGKey(0))
  # A [devices * n, n] operand split over all devices: each multiplies its own n x n block.
  sharding = NamedSharding(mesh, PartitionSpec(mesh.axis_names))
  a = jax.device_put(jax.random.normal(key_a, (devices * n, n), dtype), sharding)
  replicated = NamedSharding(mesh, PartitionSpec())
  b = jax.device_put(jax.random.normal(key_b, (n, n), dtype), replicated)
  matmul = jax.jit(lambda a, b: a @ b, out_shardings=sharding)

  def call():
    out = None
    for _ in range(chain):
      out = matmul(a, b)
    return out

  time_calls(call, 2)  # compile, warm up
  return call, 2.0 * devices * n**3 * chain


def synthetic_batch(rows: int, length: int, vocab_size: int):
  import numpy as np

  rng = np.random.default_rng(0)
  tokens = lambda: rng.integers(3, vocab_size, size=(rows, length), dtype=np.int32)  # noqa: E731
  decoder_inputs = tokens()
  decoder_inputs[:, 0] = 1  # BOS
  return {"inputs": tokens(), "decoder_inputs": decoder_inputs, "targets": tokens()}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  import functools

  import jax
  import numpy as np

  from transformer_jax import config as config_lib
  from transformer_jax import tasks
  from transformer_jax.data import pipeline
  from transformer_jax.data.tokenizer import PAD_ID
  from transformer_jax.model.transformer import Transformer
  from transformer_jax.parallel import xla_flags
  from transformer_jax.training import train

  config = cli.config_value(_CONFIG)
  config_lib.validate(config)
  if bool(_BATCH_SIZE.value) != bool(_SEQ_LEN.value):
    raise UserError(
        f"--batch_size={_BATCH_SIZE.value} --seq_len={_SEQ_LEN.value}: give both (a synthetic "
        "batch) or neither (the first training batch of the config's data)"
    )
  if _SEQ_LEN.value > config.model.max_len:
    raise UserError(
        f"--seq_len={_SEQ_LEN.value} exceeds config.model.max_len={config.model.max_len}"
    )
  xla_flags.apply(config.xla_flags)  # as train.run does: the step timed is the step trained
  dataset = None if _BATCH_SIZE.value else pipeline.load_dataset(config)
  vocab_size = dataset.tokenizer.vocab_size if dataset else config.data.vocab_size
  if dataset is None:
    trainer = train.Trainer(config, config_lib.model_config(config, vocab_size))
  else:  # the task's model, batch transform and loss, as train.py builds them
    trainer = train.Trainer.for_task(config, tasks.get(config.task), dataset.tokenizer)
  model_config = trainer.model_config
  if dataset is None:
    host_batch = synthetic_batch(_BATCH_SIZE.value, _SEQ_LEN.value, vocab_size)
    source = "random tokens (--batch_size, --seq_len)"
  else:
    host_batch = next(iter(train.train_batches(config, dataset, trainer)))  # as training reads it
    packed = " (packed rows)" if config.data.packing else ""
    source = f"first training batch of data.source={config.data.source!r}{packed}"
  rows, source_len = host_batch["inputs"].shape[:2]  # [B, S] (or [B, S, 1 + C]: spellings)
  target_len = host_batch["targets"].shape[1]
  target_tokens = int(np.count_nonzero(host_batch["targets"] != PAD_ID))

  with trainer._context():
    batch = trainer.to_global(host_batch)  # on the devices once: the steps time compute only
    state = trainer.init_state(config.seed)
    rng = jax.random.PRNGKey(0)
    # The jitted step itself (Trainer.train_step would also transfer the host batch each call).
    step = trainer._jit_train_step
    start = time.perf_counter()
    compiled = step.lower(state, batch, rng).compile()
    compile_s = time.perf_counter() - start
    cost = compiled.cost_analysis()  # a dict, or a list of one on older JAX; may lack "flops"
    cost = cost[0] if isinstance(cost, (list, tuple)) and cost else cost
    xla_flops = float(cost["flops"]) if cost and "flops" in cost else None

    holder = {"state": state}

    def one_step():
      holder["state"], metrics = step(holder["state"], batch, rng)
      return holder["state"], metrics

    time_calls(one_step, _WARMUP.value)
    # Steps and peak matmuls alternate, so that both see the same machine (a shared CPU's load
    # changes within seconds).
    on_cpu = jax.default_backend() == "cpu"
    peak_n = _PEAK_N.value or (2048 if on_cpu else 8192)
    peak_chain = _PEAK_CHAIN.value or (1 if on_cpu else 10)
    dtype = model_config.dtype
    matmul, matmul_flops = peak_matmul(dtype, peak_n, trainer.mesh, peak_chain)
    step_times, peak_times = [], []
    for i in range(max(_STEPS.value, _PEAK_REPEATS.value)):
      if i < _STEPS.value:
        step_times += time_calls(one_step, 1)
      if i < _PEAK_REPEATS.value:
        peak_times += time_calls(matmul, 1)

    breakdown = {}
    if _BREAKDOWN.value:
      loss = functools.partial(train.loss_and_metrics, model=trainer.train_model, loss=trainer.loss)
      params = holder["state"].params
      rngs = {"dropout": rng}
      forward = jax.jit(lambda p, b: loss(p, b, rngs=rngs)[0])
      backward = jax.jit(lambda p, b: jax.grad(lambda q: loss(q, b, rngs=rngs)[0])(p))
      for name, fn in (("forward_s", forward), ("forward_backward_s", backward)):
        call = functools.partial(fn, params, batch)
        jax.block_until_ready(call())  # compile
        breakdown[name] = round(statistics.median(time_calls(call, 5)), 5)

  peak = matmul_flops / statistics.median(peak_times)
  step_s = statistics.median(step_times)
  flops = model_flops_per_step(model_config, rows, source_len, target_len)
  flops_count = "analytic matmul FLOPs (benchmarks/throughput.py docstring)"
  if not isinstance(trainer.train_model, Transformer) and xla_flops:
    flops = xla_flops  # the task's own model: the analytic count is the paper's Transformer's
    flops_count = f"XLA's count: {type(trainer.train_model).__name__} is the task's own model"
  achieved = flops / step_s
  devices = trainer.mesh.devices
  nominal = nominal_peak(devices.flat[0].device_kind, np.dtype(dtype).name)
  nominal = nominal * devices.size if nominal else None
  print(
      json.dumps(
          {
              "benchmark": "train_step_throughput",
              "device": f"{devices.size}x {devices.flat[0].device_kind}",
              **machine.describe(),
              "backend": jax.default_backend(),
              "dtype": np.dtype(dtype).name,
              "mesh": dict(trainer.mesh.shape),
              "sharding_rules": config.sharding_rules,
              "batch": source,
              "batch_shape": [rows, source_len, target_len],
              "target_tokens_per_step": target_tokens,
              "model": {
                  "layers": model_config.num_layers,
                  "d_model": model_config.d_model,
                  "heads": model_config.num_heads,
                  "d_ff": model_config.d_ff,
                  "vocab": vocab_size,
                  "attention_impl": model_config.attention_impl,
                  "remat_policy": model_config.remat_policy,
                  "scan_layers": model_config.scan_layers,
              },
              "compile_s": round(compile_s, 2),
              "step_time_s": round(step_s, 5),
              "step_time_min_s": round(min(step_times), 5),
              "tokens_per_s": round(target_tokens / step_s, 1),
              "flops_per_step": flops,
              "flops_count": flops_count,
              "xla_flops_per_step": xla_flops,
              "achieved_flops_per_s": round(achieved),
              "peak_flops": round(peak),
              "peak_matmul": (
                  f"{peak_n}x{peak_n}x{peak_n} {np.dtype(dtype).name}, per device x {devices.size},"
                  f" {peak_chain} back to back"
              ),
              "mfu": round(achieved / peak, 4),
              "nominal_peak_flops": nominal,
              "mfu_nominal": round(achieved / nominal, 4) if nominal else None,
              **breakdown,
          }
      )
  )


if __name__ == "__main__":
  cli.run(main)
