"""Training: the state, pure step functions jitted once over a device mesh, and the loop.

`run(config, workdir)` is the whole job: validate the config, read and tokenize the data, create
the parameters already sharded, resume from the latest checkpoint in `workdir` if there is one,
train with periodic logging/evaluation/checkpointing, and write the final evaluation to
`workdir/results.json`. A SIGTERM (preemption) stops it at the next step with a checkpoint and
no final evaluation (preemption.py); running it again resumes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import tqdm

from transformer_jax import cli, errors, files, tasks
from transformer_jax import config as config_lib
from transformer_jax.data import batching, pipeline
from transformer_jax.model.config import TransformerConfig
from transformer_jax.model.transformer import Transformer
from transformer_jax.parallel import distributed, sharding, xla_flags
from transformer_jax.runs import checkpoint, inference, workdir_lock
from transformer_jax.training import losses, optim, preemption

# Keys of a batch the model reads; "targets" feeds the loss only, "index" is host-side only.
# A task's model may read fewer (tasks/base.py `Task.batch_keys`).
MODEL_KEYS = (
    "inputs",
    "decoder_inputs",
    "inputs_positions",
    "targets_positions",
    "inputs_segmentation",
    "targets_segmentation",
)


# loss(outputs, batch) -> (loss_sum, metric sums): the task's (tasks/base.py `Task.loss`).
Loss = Callable[[Any, dict], tuple[jax.Array, dict]]


@flax.struct.dataclass
class TrainState:
  step: jax.Array  # number of updates applied so far
  params: Any
  opt_state: Any


# ----------------------------------------------------------------------------- pure steps


def _model_kwargs(batch: dict) -> dict:
  return {k: batch[k] for k in MODEL_KEYS if k in batch}


def loss_and_metrics(params, batch, *, model: nn.Module, loss: Loss, rngs=None):
  """`loss(outputs, batch)`: the summed loss and metric sums of the model's outputs on `batch`
  (the task's loss, tasks/base.py `Task.loss`; the paper's by default)."""
  return loss(model.apply({"params": params}, **_model_kwargs(batch), rngs=rngs), batch)


def train_step(
    state: TrainState,
    batch: dict,
    dropout_rng: jax.Array,
    *,
    model: nn.Module,
    optimizer: optax.GradientTransformation,
    schedule: optax.Schedule,
    loss: Loss,
    grad_accum_steps: int,
    batch_transform: Callable[[dict, jax.Array], dict] | None = None,
) -> tuple[TrainState, dict]:
  """One update. The gradient is of the loss summed over the batch's target tokens, divided by
  their count: the mean over the whole global batch, however it is split into micro-batches.
  `batch_transform(batch, rng)` (the task's, tasks/base.py) is applied first; `loss`: see
  `loss_and_metrics`."""
  rng = jax.random.fold_in(dropout_rng, state.step)
  if batch_transform is not None:  # its own stream: the dropout masks stay those without it
    batch = batch_transform(batch, jax.random.fold_in(rng, 2**31 - 1))
  grad_fn = jax.grad(functools.partial(loss_and_metrics, model=model, loss=loss), has_aux=True)

  if grad_accum_steps == 1:
    grads, metrics = grad_fn(state.params, batch, rngs={"dropout": rng})
  else:
    # Micro-batch k takes rows k, k + A, k + 2A, ... so each device's rows split evenly across
    # micro-batches and no data moves between devices. [B, L] -> [A, B/A, L].
    micro = jax.tree.map(
        lambda x: x.reshape(
            x.shape[0] // grad_accum_steps, grad_accum_steps, *x.shape[1:]
        ).swapaxes(0, 1),
        batch,
    )

    def accumulate(carry, inputs):
      grads_acc, metrics_acc = carry
      index, micro_batch = inputs
      grads, metrics = grad_fn(
          state.params, micro_batch, rngs={"dropout": jax.random.fold_in(rng, index)}
      )
      return (
          jax.tree.map(jnp.add, grads_acc, grads),
          jax.tree.map(jnp.add, metrics_acc, metrics),
      ), None

    zeros = lambda tree: jax.tree.map(jnp.zeros_like, tree)  # noqa: E731
    metric_shapes = jax.eval_shape(
        lambda: grad_fn(state.params, jax.tree.map(lambda x: x[0], micro), rngs={"dropout": rng})[1]
    )
    init = (zeros(state.params), jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), metric_shapes))
    (grads, metrics), _ = jax.lax.scan(accumulate, init, (jnp.arange(grad_accum_steps), micro))

  denominator = jnp.maximum(metrics["weight_sum"], 1.0)
  grads = jax.tree.map(lambda g: g / denominator, grads)
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  metrics["learning_rate"] = schedule(state.step)
  metrics["grad_norm"] = optax.global_norm(grads)
  return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics


def eval_step(params, batch, *, model: nn.Module, loss: Loss) -> dict:
  return loss_and_metrics(params, batch, model=model, loss=loss)[1]


def summarize(metric_sums: dict) -> dict:
  """Sums over tokens -> per-token loss, perplexity (of the unsmoothed NLL) and accuracy."""
  weight = max(float(metric_sums["weight_sum"]), 1.0)
  nll = float(metric_sums["nll_sum"]) / weight
  return {
      "loss": float(metric_sums["loss_sum"]) / weight,
      "nll": nll,
      "perplexity": math.exp(min(nll, 100.0)),
      "accuracy": float(metric_sums["correct_sum"]) / weight,
  }


# ----------------------------------------------------------------------------- set-up


class Trainer:
  """Everything `run` builds from a config: mesh, model, optimizer and the jitted functions."""

  def __init__(
      self,
      config: ml_collections.ConfigDict,
      model: nn.Module | TransformerConfig,
      devices: list[jax.Device] | None = None,
      *,
      loss: Loss | None = None,
      batch_keys: tuple[str, ...] | None = None,
      batch_transform: Callable[[dict, jax.Array], dict] | None = None,
      constraint: Any = None,
      predictor: Any = None,
      task: Any = None,
  ):
    """`task`: the run's (tasks/base.py; None: `config.task`'s), which scores its evaluations.
    `model`: the run's (a TransformerConfig: the paper's Transformer of it); `loss`,
    `batch_transform`: `train_step`'s (default: the paper's loss, none); `batch_keys`: the keys
    of a batch sent to the devices (None: all); `constraint`: the searches'; `predictor`: what
    decodes in the place of the search (a span chart's parses). The run's task supplies them
    (tasks/base.py, `Trainer.for_task`)."""
    if isinstance(model, TransformerConfig):
      model = Transformer(model)
    model_config = model.config
    if loss is None:
      loss = functools.partial(losses.sequence_loss, label_smoothing=config.train.label_smoothing)
    self.config = config
    self.loss = loss
    self.task = tasks.get(config.task) if task is None else task
    self.model_config = model_config
    self.batch_keys = batch_keys
    self.mesh = sharding.make_mesh(config.mesh, devices)
    self.rules = sharding.get_rules(config.sharding_rules)
    self.batch_sharding = sharding.batch_sharding(self.mesh)
    self.replicated = sharding.replicated(self.mesh)
    self.schedule = optim.make_schedule(
        model_config.d_model,
        config.train.warmup_steps,
        config.train.lr_multiplier,
        num_steps=config.train.num_steps,
        cooldown_steps=config.train.cooldown_steps,
    )
    self.optimizer = optim.make_optimizer(
        self.schedule,
        b1=config.train.adam_b1,
        b2=config.train.adam_b2,
        eps=config.train.adam_eps,
        grad_clip_norm=config.train.grad_clip_norm,
    )
    self.train_model = model
    self.eval_model = model.clone(config=model_config.replace(deterministic=True))
    self.state_shardings = sharding.logical_to_shardings(
        jax.eval_shape(self._init_boxed, jax.random.PRNGKey(0)), self.mesh, self.rules
    )
    self._jit_init = jax.jit(
        lambda rng: nn.unbox(self._init_boxed(rng)), out_shardings=self.state_shardings
    )
    step = functools.partial(
        train_step,
        model=self.train_model,
        optimizer=self.optimizer,
        schedule=self.schedule,
        loss=loss,
        grad_accum_steps=config.train.grad_accum_steps,
        batch_transform=batch_transform,  # its arrays are constants of the compiled step
    )
    self._jit_train_step = jax.jit(
        step,
        in_shardings=(self.state_shardings, self.batch_sharding, self.replicated),
        out_shardings=(self.state_shardings, self.replicated),
        donate_argnums=(0,),
    )
    self._jit_eval_step = jax.jit(
        functools.partial(eval_step, model=self.eval_model, loss=loss),
        in_shardings=(self.state_shardings.params, self.batch_sharding),
        out_shardings=self.replicated,
    )
    self.predictor = predictor or inference.eval_predictor(config, model, constraint)

  @classmethod
  def for_task(cls, config, task, tokenizer, devices=None) -> Trainer:
    """The trainer of a run of `task` over `tokenizer`'s vocabulary: its model, loss, batch keys,
    batch transform, constraint and predictor (tasks/base.py)."""
    model = task.build_model(config, tokenizer)
    return cls(
        config,
        model,
        devices,
        loss=task.loss(config, tokenizer),
        batch_keys=task.batch_keys(config),
        batch_transform=task.batch_transform(config, tokenizer),
        constraint=task.constraint(config, tokenizer),
        predictor=task.predictor(config, model, tokenizer),
        task=task,
    )

  @property
  def num_batch_shards(self) -> int:
    """Devices the batch is split over (the data and fsdp mesh axes)."""
    return self.mesh.shape["data"] * self.mesh.shape["fsdp"]

  def _init_boxed(self, rng) -> TrainState:
    dummy = targets = jnp.zeros((1, 8), jnp.int32)  # what `init` traces: PAD tokens
    params = self.train_model.init({"params": rng, "dropout": rng}, dummy, targets)["params"]
    return TrainState(
        step=jnp.zeros((), jnp.int32), params=params, opt_state=self.optimizer.init(params)
    )

  @contextlib.contextmanager
  def _context(self):
    """The mesh and the logical-axis rules every jitted call of this trainer runs under."""
    with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.rules):
      yield

  def init_state(self, seed: int) -> TrainState:
    with self._context():
      return self._jit_init(jax.random.PRNGKey(seed))

  def abstract_state(self) -> TrainState:
    shapes = jax.eval_shape(lambda: nn.unbox(self._init_boxed(jax.random.PRNGKey(0))))
    return checkpoint.abstract_like(shapes, self.state_shardings)

  def to_global(self, local_batch: dict) -> dict:
    """This process's rows -> one global array per key, split over the batch mesh axes."""
    keys = self.batch_keys
    return {
        k: jax.make_array_from_process_local_data(self.batch_sharding, v)
        for k, v in local_batch.items()
        if k != "index" and (keys is None or k in keys)
    }

  def train_step(self, state, batch, dropout_rng):
    with self._context():
      return self._jit_train_step(state, self.to_global(batch), dropout_rng)

  def evaluate_loss(self, params, examples, bucket_lengths) -> dict:
    sums = None
    with self._context():
      for batch in self._eval_batches(examples, bucket_lengths):
        m = self._jit_eval_step(params, self.to_global(batch))
        sums = m if sums is None else jax.tree.map(jnp.add, sums, m)
    return summarize(jax.device_get(sums))

  def decode(self, params, examples, bucket_lengths, tokenizer) -> list[str]:
    """The outputs of `examples`' sources with the run's decoding settings, as text, in order:
    the path the commands take (`inference.decode_sources`). References are never read."""
    with self._context():
      outputs = inference.decode_sources(
          self.predictor,
          params,
          [source for source, _ in examples],
          bucket_lengths,
          self.mesh,
          beam_size=self.config.eval.beam_size,
          alpha=self.config.eval.alpha,
          batch_tokens=self.config.eval.batch_tokens,
      )
    return [tokenizer.decode(tokens.tolist()) for tokens in outputs]

  def _eval_batches(self, examples, bucket_lengths):
    """Global eval batches (fixed shapes), this process's slice of each."""
    global_rows = _round_up(self.config.eval.batch_size, self.num_batch_shards)
    process_rows = global_rows // jax.process_count()
    start = jax.process_index() * process_rows
    for batch in batching.eval_batches(examples, global_rows, bucket_lengths):
      yield {k: v[start : start + process_rows] for k, v in batch.items()}


def train_batches(config, dataset, trainer: Trainer) -> batching.BatchIterator:
  """This process's training batches of `dataset` as `config.data` asks for them (buckets or
  packed rows, ~tokens_per_batch per side), rows a multiple of the trainer's batch shards."""
  try:
    return batching.BatchIterator(
        dataset.splits["train"].examples,
        seed=config.seed,
        bucket_lengths=dataset.bucket_lengths(config.data),
        tokens_per_batch=config.data.tokens_per_batch,
        batch_multiple=batch_multiple(config, trainer.num_batch_shards),
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        packing=config.data.get("packing", False),  # configs saved before the key existed
        packed_source_len=config.data.get("packed_source_len", 0),
    )
  except ValueError as e:  # the data and the batch settings do not fit: e.g. no full batch
    raise config_lib.ConfigError(f"config.data: {e}") from None


def batch_multiple(config: ml_collections.ConfigDict, num_batch_shards: int) -> int:
  """Global rows of every training batch are a multiple of this: the devices the batch is split
  over times the micro-batches (every device gets equal rows of each), the processes (equal rows
  each), and `data.row_multiple`, so that a run can resume on any device count dividing it."""
  return math.lcm(
      num_batch_shards * config.train.grad_accum_steps,
      jax.process_count(),
      config.data.get("row_multiple", 1),  # configs saved before the key existed
  )


def _check_devices(config: ml_collections.ConfigDict, devices) -> None:
  """A mesh these devices cannot form, or a token budget too small for one row per device, is a
  UserError now, before any data is read."""
  mesh = sharding.make_mesh(config.mesh, devices)
  shards = mesh.shape["data"] * mesh.shape["fsdp"]
  multiple = batch_multiple(config, shards)
  d = config.data
  if d.tokens_per_batch < multiple * d.max_len:
    raise config_lib.ConfigError(
        f"config.data.tokens_per_batch={d.tokens_per_batch}: batch rows are a multiple of "
        f"{multiple} ({shards} devices share the batch, train.grad_accum_steps="
        f"{config.train.grad_accum_steps}, {jax.process_count()} processes, data.row_multiple="
        f"{d.get('row_multiple', 1)}), so rows of data.max_len={d.max_len} need at least "
        f"{multiple * d.max_len} tokens. Raise tokens_per_batch, or lower one of those."
    )


def _round_up(x: int, multiple: int) -> int:
  return -(-x // multiple) * multiple


# ----------------------------------------------------------------------------- logging


class MetricLog:
  """Process 0 writes one JSON line per record to `workdir/metrics.jsonl` and logs it.

  The numbers of each record also go to TensorBoard event files in `workdir` (tag "kind/key",
  e.g. "train/loss"; `tensorboard --logdir WORKDIR`), and `text` adds text such as sample
  translations there, when tensorboardX is installed (`pip install .[tensorboard]`).
  metrics.jsonl stays the source for plot.py and the sweep.
  """

  def __init__(self, workdir: str):
    self.enabled = distributed.is_chief()
    self.path = os.path.join(workdir, "metrics.jsonl")
    self.tensorboard = _tensorboard_writer(workdir) if self.enabled else None
    if self.enabled:
      _end_last_record(self.path)

  def write(self, step: int, kind: str, values: dict):
    if not self.enabled:
      return
    record = {"step": int(step), "kind": kind, **values}
    with open(self.path, "a") as f:
      f.write(json.dumps(record) + "\n")
    shown = "  ".join(
        f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items()
    )
    logging.info("[%s] step %d  %s", kind, step, shown)
    if self.tensorboard is not None:
      for key, value in values.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
          self.tensorboard.add_scalar(f"{kind}/{key}", value, int(step))
      self.tensorboard.flush()  # a run may be killed at any moment (preemption)

  def text(self, step: int, tag: str, text: str):
    if self.tensorboard is not None:
      self.tensorboard.add_text(tag, text, int(step))
      self.tensorboard.flush()

  def close(self):
    if self.tensorboard is not None:
      self.tensorboard.close()


def _end_last_record(path: str) -> None:
  """Ends metrics.jsonl with a line end before this session appends to it: a process killed
  while writing a record can leave the record cut short, which would run into the next one and
  damage both (plot.read_metrics names such a line). A cut record is dropped, with a warning; a
  whole one missing only its line end gets it."""
  if not os.path.exists(path):
    return
  with open(path, "rb+") as f:
    end = keep = f.seek(0, os.SEEK_END)
    if end == 0:
      return
    f.seek(end - 1)
    if f.read(1) == b"\n":
      return
    while keep > 0:  # back, a block at a time, to the last line end
      start = max(0, keep - 65536)
      f.seek(start)
      block = f.read(keep - start)
      if b"\n" in block:
        keep = start + block.rfind(b"\n") + 1
        break
      keep = start
    f.seek(keep)
    try:
      json.loads(f.read())
    except ValueError:
      f.truncate(keep)
      logging.warning("%s: dropped its last record, cut short (%d bytes)", path, end - keep)
    else:
      f.write(b"\n")


def _tensorboard_writer(workdir: str):
  try:
    import tensorboardX  # noqa: PLC0415  an optional extra: `pip install .[tensorboard]`
  except ImportError:
    logging.info("tensorboardX is not installed: metrics go to metrics.jsonl only")
    return None
  return tensorboardX.SummaryWriter(workdir)


# Model keys that change how the model runs, not its parameters or its function: a run may
# resume with other values (say, remat on a smaller accelerator).
EXECUTION_ONLY_MODEL_KEYS = ("attention_impl", "remat_policy")


def _check_workdir_config(workdir: str, config: ml_collections.ConfigDict, task):
  """A workdir belongs to one model: resuming it under a different model config is an error."""
  path = os.path.join(workdir, "config.json")
  if os.path.exists(path):
    # Mapped to today's layout: keys added since take their defaults, moved keys move. A damaged
    # file is refused (one line naming it): the check below is what keeps a workdir one model's.
    saved = config_lib.load_saved(path)
    saved_model = saved.model.to_dict()
    current = json.loads(config.to_json_best_effort())
    diff = {
        k: (saved_model.get(k), v)
        for k, v in current["model"].items()
        if saved_model.get(k) != v and k not in EXECUTION_ONLY_MODEL_KEYS
    }
    for key in task.model_keys:  # the task's keys fixed at a run's start (tasks/base.py)
      was, now = saved[task.name].get(key), current[task.name][key]
      if was != now:
        diff[f"{task.name}.{key}"] = (was, now)
    if diff:
      raise config_lib.ConfigError(
          f"{workdir} holds a run with a different model config (saved, now): {diff}. "
          "Use a new --workdir, or the saved config."
      )
  if distributed.is_chief():
    # Atomically: the other processes of a multi-process run read this file at the same moment.
    def write(tmp):
      with open(tmp, "w") as f:
        f.write(config.to_json_best_effort(indent=2))

    files.atomic_write(path, write)


# ----------------------------------------------------------------------------- clocks


class Chrono:
  """The run's clocks, after big_vision's `utils.Chrono`.

  train_seconds     the run's training time, earlier sessions included (restored from the
                    checkpoint, saved with each one): what train.max_train_minutes budgets.
                    Compilation, periodic evaluation and checkpointing count.
  session_seconds   wall time since this session's loop started (`elapsed_s` in metrics.jsonl).
  throughput(...)   steps and tokens per second since the last report, time spent in `paused()`
                    blocks (evaluation, checkpoint saves) left out.
  """

  # Key of the checkpoint's JSON item (beside the input pipeline's position) holding the run's
  # training time so far: train.max_train_minutes is a budget for the run, not for each session.
  _KEY = "train_seconds"

  def __init__(self, budget_minutes: float = 0.0):
    self.budget_s = 60.0 * budget_minutes  # 0: no budget
    self.prior_seconds = 0.0
    self.start_session()

  def start_session(self):
    """Starts this session's clock (set-up and the initial compilation of `init` stay out)."""
    self._session_start = self._interval_start = time.perf_counter()
    self._paused_s, self._steps = 0.0, 0

  def load(self, checkpoint_state: dict):
    """Takes the earlier sessions' time out of a restored checkpoint's JSON item."""
    # Checkpoints written before the field existed count as no time spent.
    self.prior_seconds = float(checkpoint_state.pop(self._KEY, 0.0))

  def state(self) -> dict:
    return {self._KEY: self.train_seconds}

  @property
  def session_seconds(self) -> float:
    return time.perf_counter() - self._session_start

  @property
  def train_seconds(self) -> float:
    return self.prior_seconds + self.session_seconds

  def budget_spent(self, *, before_session: bool = False) -> bool:
    """Whether train.max_train_minutes is spent (`before_session`: by the earlier sessions
    alone); every process gets process 0's answer."""
    seconds = self.prior_seconds if before_session else self.train_seconds
    return bool(self.budget_s) and distributed.chief_decides(seconds >= self.budget_s)

  def tick(self):
    """One training step done."""
    self._steps += 1

  @contextlib.contextmanager
  def paused(self):
    """Time in this block is left out of throughput (not out of train_seconds)."""
    start = time.perf_counter()
    try:
      yield
    finally:
      self._paused_s += time.perf_counter() - start

  def throughput(self, tokens: float) -> dict:
    """Steps and `tokens` per second since the last call; starts the next interval."""
    now = time.perf_counter()
    seconds = max(now - self._interval_start - self._paused_s, 1e-9)
    rates = {"target_tokens_per_s": tokens / seconds, "steps_per_s": self._steps / seconds}
    self._interval_start, self._paused_s, self._steps = now, 0.0, 0
    return rates


def itstime(step: int, every: int, last_step: int | None = None) -> bool:
  """Whether `step` is on a cadence of `every` steps (0: never), or is `last_step`."""
  return (every > 0 and step % every == 0) or step == last_step


# ----------------------------------------------------------------------------- the loop


def run(
    config: ml_collections.ConfigDict, workdir: str, devices: list[jax.Device] | None = None
) -> dict:
  """Trains (or resumes) the run in `workdir`; returns the final results (also results.json).

  `devices` (default: all) are laid out as `config.mesh`. With `config.distributed.enabled`,
  this process first joins the multi-process job (see distributed.py). The run holds the
  workdir's lock (workdir_lock.py): a second run on it is refused before anything is written.
  """
  task = tasks.get(config.task)  # the run's task, resolved once and handed down
  config_lib.validate(config, task)
  cli.check_directory(workdir)  # a file at it, or at a parent: before anything is written
  xla_flags.apply(config.xla_flags)  # before JAX creates a backend, which reads XLA_FLAGS
  distributed.initialize(config)  # before anything asks JAX for devices or the process index
  _check_devices(config, devices)  # a mesh or batch this machine cannot hold: before any data
  cli.make_directory(workdir)
  with workdir_lock.hold(workdir, "train"):  # one writer: a second run is refused here
    return _train(config, workdir, devices, task)


@dataclasses.dataclass
class _Session:
  """One training session of a run (a start or a resume): what the loop and the finish share,
  its data, trainer and bookkeeping."""

  config: ml_collections.ConfigDict
  workdir: str
  dataset: Any
  trainer: Trainer
  train_iter: batching.BatchIterator
  eval_buckets: Any
  manager: Any  # checkpoint.make_manager's Orbax CheckpointManager
  chrono: Chrono
  log: MetricLog | None = None
  # train.select_on_validation: the best score so far and the step it was found at (0: none)
  best_score: float = -math.inf
  best_step: int = 0
  stopped_by: str = ""


def _train(config: ml_collections.ConfigDict, workdir: str, devices, task) -> dict:
  """`run`'s work, under the workdir's lock: open the run, train, then finish it."""
  _check_workdir_config(workdir, config, task)
  run = _open_session(config, workdir, devices, task)
  state = _restore_or_init(
      run.manager, run.trainer, run.train_iter, run.chrono, config.seed, workdir
  )
  if config.train.select_on_validation:  # the choice so far, kept with the averaged checkpoint
    selection = (checkpoint.averaged_record(workdir) or {}).get("selection")
    if selection:
      run.best_score, run.best_step = float(selection["score"]), int(selection["step"])
  num_params = sum(x.size for x in jax.tree.leaves(state.params))
  logging.info("parameters: %d", num_params)
  run.log = MetricLog(workdir)
  state, preempted = _train_loop(run, state)
  run.manager.wait_until_finished()
  times = {
      "train_seconds": round(run.chrono.train_seconds, 1),
      "train_seconds_this_session": round(run.chrono.session_seconds, 1),
  }
  if preempted:  # the checkpoint is complete; the grace period is too short for evaluation
    run.log.write(int(state.step), "preempted", {"elapsed_s": round(run.chrono.session_seconds, 1)})
    run.log.close()
    run.manager.close()
    return {"step": int(state.step), "stopped_by": "preemption", **times}
  results = _finish(run, state, {"num_params": int(num_params), **times})
  run.log.close()
  run.manager.close()
  return results


def _open_session(config: ml_collections.ConfigDict, workdir: str, devices, task) -> _Session:
  """The dataset (vocabulary written or reused), the trainer over `devices`, the training
  iterator, the checkpoint manager and the run's clock."""
  dataset = pipeline.load_dataset(config, workdir, task=task)  # writes or reuses workdir/vocab.*
  trainer = Trainer.for_task(config, task, dataset.tokenizer, devices)
  inference.check_model(workdir, trainer.train_model)  # a resumed run: the model it trained
  if distributed.is_chief():
    inference.write_model_description(workdir, trainer.train_model)
  model_config = trainer.model_config
  train_iter = train_batches(config, dataset, trainer)
  logging.info(
      "model: %s; %d train pairs (%d truncated); rows per bucket %s; mesh %s",
      model_config,
      len(dataset.splits["train"].examples),
      train_iter.num_truncated,
      train_iter.rows_per_bucket,
      dict(trainer.mesh.shape),
  )
  t = config.train
  return _Session(
      config=config,
      workdir=workdir,
      dataset=dataset,
      trainer=trainer,
      train_iter=train_iter,
      eval_buckets=dataset.eval_bucket_lengths(config.data),
      manager=checkpoint.make_manager(
          workdir, keep=t.keep_checkpoints, save_every=t.checkpoint_every
      ),
      chrono=Chrono(t.max_train_minutes),
  )


def _train_loop(run: _Session, state: TrainState) -> tuple[TrainState, bool]:
  """Trains from `state` to train.num_steps, the time budget or a SIGTERM, logging, evaluating
  and checkpointing as the config says; returns the last state and whether it was preempted."""
  t, chrono, log, manager = run.config.train, run.chrono, run.log, run.manager
  start_step, num_steps = int(state.step), t.num_steps
  # Marks a session: its elapsed_s count from zero again (transformer_jax/plot.py adds them up).
  log.write(
      start_step,
      "start",
      {"resumed": start_step > 0, "train_seconds_before": round(chrono.prior_seconds, 1)},
  )
  # A run whose budget was spent in an earlier session trains no further: like a run that reached
  # num_steps, rerunning it only redoes the final evaluation. Raise the budget to extend it.
  last_step = start_step if chrono.budget_spent(before_session=True) else num_steps
  if last_step < num_steps:
    logging.info(
        "train.max_train_minutes=%g was spent in earlier sessions (%.0f s): no training",
        t.max_train_minutes,
        chrono.prior_seconds,
    )
  if _out_of_patience(run, start_step):
    logging.info("train.patience=%d was spent in earlier sessions: no training", t.patience)
    last_step, run.stopped_by = start_step, "train.patience"
  dropout_rng = jax.random.fold_in(jax.random.PRNGKey(run.config.seed), 1)
  periodic_eval = functools.partial(
      _periodic_eval,
      run.trainer,
      run.dataset,
      run.config.eval.num_sentences,
      run.eval_buckets,
      log,
  )
  progress = tqdm.tqdm(
      total=num_steps,
      initial=start_step,
      disable=not distributed.is_chief() or not sys.stderr.isatty(),
      dynamic_ncols=True,
  )
  pending, padding = [], []  # per step since the last train record: metrics on device, padding
  preempted = False
  chrono.start_session()
  with preemption.Preemption() as preempt:
    for step in range(start_step + 1, last_step + 1):
      batch = next(run.train_iter)
      padding.append(batching.padding_efficiency(batch))
      state, metrics = run.trainer.train_step(state, batch, dropout_rng)
      pending.append(metrics)
      chrono.tick()
      progress.update(1)

      if itstime(step, t.log_every, last_step=num_steps):
        values = _train_record(pending, padding, chrono, step, manager, run.workdir)
        log.write(step, "train", values)
        progress.set_postfix(loss=f"{values['loss']:.3f}", lr=f"{values['learning_rate']:.2e}")
        pending, padding = [], []
      # Not at the last step (the final evaluation follows), nor in a preempted run's grace
      # period, which is for the checkpoint.
      if itstime(step, t.eval_every) and step != num_steps and not preempt.requested:
        with chrono.paused():
          periodic_eval(state.params, step, elapsed_s=round(chrono.session_seconds, 1))

      out_of_time = itstime(step, t.log_every) and chrono.budget_spent()
      preempted = preempt.reached(step)  # SIGTERM: save this step, stop (preemption.py)
      with chrono.paused():
        checkpoint.save(
            manager,
            step,
            state,
            {**run.train_iter.get_state(), **chrono.state()},
            force=step == num_steps or out_of_time or preempted,
        )
      if out_of_time:
        logging.info(
            "train.max_train_minutes=%g spent: stopping at step %d of %d",
            t.max_train_minutes,
            step,
            num_steps,
        )
      selecting = itstime(step, t.eval_every, last_step=num_steps) or out_of_time
      if t.select_on_validation and selecting and not preempted:
        with chrono.paused():
          _select(run, state, step)
        if _out_of_patience(run, step) and step < num_steps:
          logging.info(
              "train.patience=%d: no better average on validation since step %d, stopping at "
              "step %d of %d", t.patience, run.best_step, step, num_steps,
          )  # fmt: skip
          run.stopped_by = "train.patience"
          break
      if out_of_time or preempted:
        break
  progress.close()
  return state, preempted


def _finish(run: _Session, state: TrainState, facts: dict) -> dict:
  """After training: the §6.1 average of the last checkpoints (or the latest parameters), the
  final evaluation, and results.json (with `facts`: parameter count, times)."""
  t, step = run.config.train, int(state.step)
  params, evaluated = state.params, f"step {step}"
  held = len(run.manager.all_steps())
  selection = None
  if t.select_on_validation and run.best_step:
    abstract = run.trainer.abstract_state().params
    params = checkpoint.load_averaged(run.workdir, abstract)
    steps = checkpoint.averaged_record(run.workdir)["steps"]
    metric = run.trainer.task.metric
    evaluated = f"average of steps {steps}, chosen on validation at step {run.best_step}"
    selection = {
        f"selected_valid_{metric}": run.best_score,
        "selected_at_step": run.best_step,
        "selected_steps": steps,
    }
  elif t.average_last and held < t.average_last:
    # A run stopped early (time budget, few steps) has fewer checkpoints than §6.1 averages; the
    # oldest could be the barely trained first one, so evaluate the latest rather than fail here.
    logging.warning(
        "train.average_last=%d but %d checkpoints exist: evaluating step %d, not an average",
        t.average_last,
        held,
        step,
    )
    evaluated += f" (not averaged: {held} checkpoints < train.average_last={t.average_last})"
  elif t.average_last:
    params, steps = checkpoint.average_manager_params(
        run.manager, run.trainer.abstract_state(), t.average_last
    )
    checkpoint.save_averaged(run.workdir, params, steps)
    evaluated = f"average of steps {steps}"
  results = final_evaluation(
      run.trainer, params, run.dataset, run.eval_buckets, run.workdir, run.log, step=step
  )
  results.update(
      parameters=evaluated,
      **(selection or {}),
      step=step,
      **facts,
      stopped_by=run.stopped_by
      or ("train.num_steps" if step >= t.num_steps else "train.max_train_minutes"),
  )
  if distributed.is_chief():
    # Atomically: the sweep takes an existing results.json for a finished row.
    def write(tmp):
      with open(tmp, "w") as f:
        json.dump(results, f, indent=2)

    files.atomic_write(os.path.join(run.workdir, "results.json"), write)
  run.log.write(step, "final", {k: v for k, v in results.items() if isinstance(v, float)})
  return results


def _restore_or_init(manager, trainer, train_iter, chrono, seed, workdir) -> TrainState:
  """The newest readable checkpoint's state, with the input pipeline's position and the run's
  time so far restored; or a new state at step 0."""
  restored = checkpoint.restore_newest_readable(manager, trainer.abstract_state())
  if restored is None:
    return trainer.init_state(seed)
  state, data_state = restored
  chrono.load(data_state)
  try:
    train_iter.set_state(data_state)
  except ValueError as e:  # e.g. a device count that does not divide the saved rows
    raise errors.UserError(
        f"{workdir}: cannot resume at step {int(state.step)}: {e} To let a run change device "
        "counts, start it with --config.data.row_multiple set to a multiple of every count."
    ) from None
  logging.info(
      "resumed from step %d in %s (%.0f s of training so far)",
      int(state.step),
      workdir,
      chrono.prior_seconds,
  )
  return state


def _train_record(pending, padding, chrono, step, manager, workdir) -> dict:
  """The train record of the steps since the last: per-token loss etc., rates, padding."""
  host = jax.device_get(pending)  # the only host<->device sync on training steps
  sums = {k: sum(m[k] for m in host) for k in ("loss_sum", "nll_sum", "correct_sum", "weight_sum")}
  values = summarize(sums)
  if not math.isfinite(values["loss"]):
    raise FloatingPointError(
        f"non-finite training loss {values['loss']} at step {step}; the last complete "
        f"checkpoint is step {manager.latest_step()} in {workdir}"
    )
  return {
      **values,
      "learning_rate": float(host[-1]["learning_rate"]),
      "grad_norm": float(host[-1]["grad_norm"]),
      **chrono.throughput(tokens=float(sums["weight_sum"])),
      "padding_efficiency": float(np.mean(padding)),
      "elapsed_s": round(chrono.session_seconds, 1),  # wall time this session
  }


def _out_of_patience(run: _Session, step: int) -> bool:
  """train.patience evaluations in a row, up to `step`, found no better average."""
  t = run.config.train
  return bool(t.patience and run.best_step) and (step - run.best_step) // t.eval_every >= t.patience


def _select(run: _Session, state: TrainState, step: int) -> None:
  """train.select_on_validation: scores the mean of the last train.average_last checkpoints (the
  latest parameters with 0) on the whole validation split by the task's metric; the best so far
  becomes the averaged checkpoint, with its score (checkpoint.save_averaged)."""
  t, trainer = run.config.train, run.trainer
  run.manager.wait_until_finished()
  if t.average_last and len(run.manager.all_steps()) >= t.average_last:
    params, steps = checkpoint.average_manager_params(
        run.manager, trainer.abstract_state(), t.average_last
    )
  else:
    params, steps = state.params, [step]
  split = run.dataset.splits["eval"]
  hypotheses = trainer.decode(params, split.examples, run.eval_buckets, run.dataset.tokenizer)
  metric = trainer.task.metric
  score = float(trainer.task.scores(run.config, hypotheses, split.pairs)[metric])
  if score > run.best_score:
    run.best_score, run.best_step = score, step
    selection = {"metric": metric, "score": score, "step": step}
    checkpoint.save_averaged(run.workdir, params, steps, selection=selection)
  run.log.write(
      step,
      "select",
      {
          f"valid_{metric}": score,
          "averaged_from": int(steps[0]),
          f"best_valid_{metric}": run.best_score,
          "best_step": run.best_step,
      },
  )


def _periodic_eval(trainer, dataset, num_sentences, buckets, log, params, step, elapsed_s):
  """Validation loss and the task's scores on the first `num_sentences` pairs, the training
  pairs' loss."""
  examples = dataset.splits["eval"].examples[:num_sentences]
  pairs = dataset.splits["eval"].pairs[:num_sentences]
  references = [t for _, t in pairs]
  # As many training pairs: their loss with dropout off, beside validation's, shows when the
  # model starts to memorize the training set.
  train_examples = dataset.splits["train"].examples[:num_sentences]
  values = trainer.evaluate_loss(params, examples, buckets)
  values.update(_train_subset_loss(trainer, params, train_examples, buckets))
  hypotheses = trainer.decode(params, examples, buckets, dataset.tokenizer)
  values.update(trainer.task.scores(trainer.config, hypotheses, pairs))
  values["elapsed_s"] = elapsed_s
  log.write(step, "eval", values)
  _log_samples(log, step, "eval/translations", hypotheses, references)


def _log_samples(log, step, tag, hypotheses, references, num=3):
  """The first `num` translations beside their references: to the log and TensorBoard's text."""
  samples = list(zip(hypotheses, references))[:num]
  for hyp, ref in samples:
    logging.info("  hyp: %s\n  ref: %s", hyp, ref)
  log.text(step, tag, "\n\n".join(f"hyp: {hyp}  \nref: {ref}" for hyp, ref in samples))


def _train_subset_loss(trainer: Trainer, params, examples, buckets) -> dict:
  """NLL and perplexity on training pairs with dropout off, as validation's are measured.

  Their distance from validation's is the generalization gap; the training loss logged during
  training has dropout on, so it overstates the loss on these same pairs.
  """
  if not examples:
    return {}
  metrics = trainer.evaluate_loss(params, examples, buckets)
  return {"train_subset_nll": metrics["nll"], "train_subset_perplexity": metrics["perplexity"]}


def final_evaluation(
    trainer: Trainer,
    params,
    dataset,
    buckets,
    workdir: str,
    log: MetricLog | None = None,
    step: int = 0,
) -> dict:
  """Loss/perplexity on the eval split and on as many training pairs (dropout off); the test
  split decoded and scored by the run's task, which writes its test outputs to the workdir
  (tasks/). `log` gets sample outputs at `step`."""
  eval_split, test_split = dataset.splits["eval"], dataset.splits["test"]
  eval_metrics = trainer.evaluate_loss(params, eval_split.examples, buckets)
  train_subset = dataset.splits["train"].examples[: len(eval_split.examples)]
  train_metrics = _train_subset_loss(trainer, params, train_subset, buckets)
  hypotheses = trainer.decode(params, test_split.examples, buckets, dataset.tokenizer)
  references = [t for _, t in test_split.pairs]
  test_metrics = trainer.task.test_results(
      trainer.config, hypotheses, test_split.pairs, workdir if distributed.is_chief() else None
  )
  if log is not None:
    _log_samples(log, step, "test/translations", hypotheses, references)
  return {
      "eval_loss": eval_metrics["loss"],
      "eval_nll": eval_metrics["nll"],
      "eval_perplexity": eval_metrics["perplexity"],
      "eval_accuracy": eval_metrics["accuracy"],
      **train_metrics,
      "train_subset_sentences": len(train_subset),
      **test_metrics,
      "test_sentences": len(references),
      "decoding": (
          "greedy"
          if trainer.config.eval.beam_size == 1
          else f"beam {trainer.config.eval.beam_size}, alpha {trainer.config.eval.alpha}"
      ),
  }
