"""A trained run, loaded for inference: its config, vocabulary and parameters, and decoding.

  run = inference.load_run(workdir)         # "auto"; or "latest", "avg", a step number
  run.decode_lines(["A man rides a bike."])  # -> ["Ein Mann fährt Fahrrad."] (a translation run)

Only the parameters are read from a checkpoint (an Orbax partial restore of `state/params`): no
optimizer state, no optimizer, no train step. `decode_sources` is the one decoding path of every
task (the commands and training's evaluations): it sorts sentences by length, cuts them into batches
of about `batch_tokens` source tokens padded to a few bucket lengths (one compiled search per
bucket), decodes them with the run's predictor (`decode.Predictor`, or the task's), and returns
them in input order. Decoding
settings (beam size, α) can be changed per call without reloading or recompiling for α.

This module is library code; the commands that use it are translate, parse, tune_decoding,
average, plot_attention and benchmarks/decode.py.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Iterator, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

from transformer_jax import config as config_lib
from transformer_jax import errors, files, tasks
from transformer_jax.data import pipeline
from transformer_jax.data.tokenizer import EOS_ID, PAD_ID, Tokenizer
from transformer_jax.decoding import batch_shapes, decode, decoder
from transformer_jax.model.config import TransformerConfig
from transformer_jax.model.transformer import Transformer
from transformer_jax.parallel import sharding, xla_flags
from transformer_jax.runs import checkpoint

CHECKPOINT_CHOICES = "a step number, 'latest', 'avg' or 'auto'"
# Source tokens per decoding batch (rows = batch_tokens // bucket length): measured on the
# Multi30k model on a 2-core CPU, see benchmarks/decode.py.
DEFAULT_BATCH_TOKENS = 2048


def load_config(
    workdir: str,
    beam_size: int | None = None,
    alpha: float | None = None,
    shapes: str | None = None,
    overrides: dict[str, Any] | None = None,
):
  """The run's saved config (on top of today's defaults), set up to decode on this machine's
  devices: batch split over all of them, parameters replicated; the eval settings given and
  `overrides` ({"section.key": value}, e.g. a task's decoding switch) override the run's."""
  path = os.path.join(workdir, "config.json")
  if not os.path.exists(path):
    raise errors.UserError(f"{workdir} has no config.json: is it the --workdir of a training run?")
  config = config_lib.load_saved(path)  # a damaged file: one line naming it
  config.mesh = ml_collections.ConfigDict({"data": -1, "fsdp": 1, "tensor": 1})
  if beam_size is not None:
    config.eval.beam_size = beam_size
  if alpha is not None:
    config.eval.alpha = alpha
  if shapes is not None:
    config.eval.shapes = shapes
  set_values(config, overrides or {})
  config_lib.validate(config)
  xla_flags.apply(config.xla_flags)  # no-op once JAX has started (e.g. after training in-process)
  return config


def set_values(config: ml_collections.ConfigDict, values: dict[str, Any]) -> None:
  """Sets each "section.key" of `values` in `config`; a key it does not have is a UserError."""
  for dotted, value in values.items():
    *parents, key = dotted.split(".")
    section = config
    for part in parents:
      section = section.get(part)
      if not isinstance(section, ml_collections.ConfigDict):
        raise errors.UserError(f"config.{dotted}: this run's config has no such key")
    if key not in section:
      raise errors.UserError(f"config.{dotted}: this run's config has no such key")
    section[key] = value


def abstract_params(model: nn.Module | TransformerConfig, param_sharding) -> Any:
  """ShapeDtypeStructs of the model's parameters (nothing computed), laid out by
  `param_sharding`. `model`: the run's (a TransformerConfig: the paper's Transformer of it)."""
  if isinstance(model, TransformerConfig):
    model = Transformer(model)
  dummy = targets = jnp.zeros((1, 8), jnp.int32)  # what `init` traces: PAD tokens
  shapes = jax.eval_shape(
      lambda: nn.unbox(model.init(jax.random.PRNGKey(0), dummy, targets))["params"]
  )
  return jax.tree.map(
      lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=param_sharding), shapes
  )


def restore_params(workdir: str, step: int, abstract: Any) -> Any:
  """The parameters of checkpoint `step`, and nothing else of it (Orbax partial restore of the
  `params` subtree of the saved train state: the Adam moments are never restored, though the
  digest check reads all of the step's files)."""
  path = os.path.join(os.path.abspath(workdir), "checkpoints", str(step), "state")
  if not os.path.isdir(path):
    raise checkpoint.CheckpointError(f"checkpoint step {step} has no state directory {path}")
  checkpoint.verify_step(os.path.dirname(os.path.dirname(path)), step)  # before anything is read
  item = {"params": abstract}
  restore_args = jax.tree.map(lambda s: ocp.ArrayRestoreArgs(sharding=s.sharding), item)
  try:
    with ocp.PyTreeCheckpointer() as checkpointer:
      restored = checkpointer.restore(
          path,
          args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True),
      )
  except Exception as e:
    raise checkpoint.CheckpointError(
        f"the parameters of checkpoint step {step} in {path} cannot be restored: "
        f"{type(e).__name__}: {str(e).strip()[:300]}"
    ) from e
  return restored["params"]


def checkpoint_steps(workdir: str) -> list[int]:
  """The steps saved in `workdir/checkpoints`, ascending."""
  with checkpoint.make_manager(workdir, keep=1, save_every=1) as manager:
    return sorted(manager.all_steps())


def averaged_steps(workdir: str) -> list[int] | None:
  """The steps `workdir`'s averaged checkpoint (§6.1) was made from, or None if it has none."""
  record = checkpoint.averaged_record(workdir)
  return None if record is None else record["steps"]


def average_workdir_params(workdir: str, abstract: Any, num: int) -> tuple[Any, list[int]]:
  """§6.1: the mean of the parameters of the last `num` checkpoints (5 for base, 20 for big).

  Returns (params float32, steps). Parameters only, one checkpoint at a time beside the sum.
  """
  steps = checkpoint_steps(workdir)[-num:]
  if len(steps) < num:
    raise errors.UserError(
        f"asked to average {num} checkpoints but {workdir}/checkpoints holds {len(steps)} "
        f"({steps}); raise train.keep_checkpoints to keep enough"
    )
  return checkpoint.mean_params(steps, lambda step: restore_params(workdir, step, abstract)), steps


def resolve_checkpoint(workdir: str, which: str, average_last: int) -> tuple[str, int | None]:
  """`which` ("auto", "latest", "avg" or a step) -> ("avg", None) or ("step", step).

  "auto" is what the run's final evaluation used: the average when the run averages
  (train.average_last) and the average includes the latest checkpoint, or when the average was
  chosen on validation (train.select_on_validation); else the latest.
  """
  if which not in ("auto", "latest", "avg") and not str(which).isdigit():
    raise errors.UserError(f"--checkpoint={which!r}: expected {CHECKPOINT_CHOICES}")
  steps = checkpoint_steps(workdir)
  if which == "auto":
    record = checkpoint.averaged_record(workdir)
    averaged = None if record is None else record["steps"]
    current = bool(averaged) and bool(steps) and max(averaged) == max(steps)
    chosen = record is not None and "selection" in record  # chosen on validation: the run's
    which = "avg" if (average_last and current) or chosen else "latest"
  if which == "avg":
    return "avg", None
  if not steps:
    raise errors.UserError(
        f"{workdir} has no checkpoint yet (checkpoints/ is empty): train first, or pass the "
        "--workdir of a run that has saved one"
    )
  step = max(steps) if which == "latest" else int(which)
  if step not in steps:
    raise errors.UserError(f"--checkpoint={which}: {workdir} holds steps {steps}")
  return "step", step


@dataclasses.dataclass
class LoadedRun:
  """A trained run ready to decode. `predictor` takes α and the beam size per call."""

  config: ml_collections.ConfigDict
  task: Any  # tasks/base.py Task: the run's, resolved once where it was loaded
  tokenizer: Tokenizer
  model: nn.Module  # the task's (Task.build_model)
  params: Any
  checkpoint: str  # which parameters: "step N" or "average of steps [...]"
  predictor: decode.Predictor
  mesh: jax.sharding.Mesh

  @property
  def model_config(self) -> TransformerConfig:
    return self.model.config

  @property
  def beam_size(self) -> int:
    return self.config.eval.beam_size

  @property
  def alpha(self) -> float:
    return self.config.eval.alpha

  def with_overrides(self, overrides: dict[str, Any]) -> LoadedRun:
    """The same run and parameters, its search built for the config with `overrides`
    ({"section.key": value}) set (the task's constraint made again)."""
    if all(config_lib.config_value(self.config, k) == v for k, v in overrides.items()):
      return self
    config = ml_collections.ConfigDict(self.config.to_dict())
    set_values(config, overrides)
    config_lib.validate(config, self.task)
    predictor = run_predictor(config, self.task, self.model, self.tokenizer)
    return dataclasses.replace(self, config=config, predictor=predictor)

  def encode_lines(self, lines: Sequence[str]) -> list[list[int] | None]:
    """Token ids per line (None for an empty line); a line longer than the run's data.max_len is
    truncated with a warning naming it."""
    limit = self.config.data.max_len - 1  # room for EOS
    out = []
    for number, line in enumerate(lines, start=1):
      text = line.strip()
      if not text:
        out.append(None)
        continue
      ids = self.tokenizer.encode(text)
      if len(ids) > limit:
        logging.warning(
            "line %d has %d tokens; the model was trained on at most %d: decoding its "
            "first %d", number, len(ids), limit, limit,
        )  # fmt: skip
        ids = ids[:limit]
      out.append(ids)
    return out

  def decode_lines(self, lines: Sequence[str], **kwargs) -> list[str]:
    """Decodes each line, in order; empty lines stay empty. kwargs: see `decode_ids`."""
    encoded = self.encode_lines(lines)
    where = [i for i, ids in enumerate(encoded) if ids is not None]
    out = [""] * len(lines)
    for i, hyp in zip(where, self.decode_ids([encoded[i] for i in where], **kwargs)):
      out[i] = hyp
    return out

  def decode_ids(
      self,
      sources: Sequence[Sequence[int]],
      *,
      beam_size: int | None = None,
      alpha: float | None = None,
      batch_tokens: int | None = None,
      stats: dict | None = None,
  ) -> list[str]:
    """The detokenized outputs of token-id sources (no EOS), in order (`decode_sources`)."""
    with jax.set_mesh(self.mesh):
      outputs = decode_sources(
          self.predictor,
          self.params,
          sources,
          pipeline.eval_bucket_lengths(self.config.data),
          self.mesh,
          beam_size=self.beam_size if beam_size is None else beam_size,
          alpha=self.alpha if alpha is None else alpha,
          batch_tokens=self.config.eval.batch_tokens if batch_tokens is None else batch_tokens,
          stats=stats,
      )
    return [self.tokenizer.decode(tokens.tolist()) for tokens in outputs]


def decode_sources(
    predictor: decode.Predictor,
    params,
    sources: Sequence[Sequence[int]],
    bucket_lengths: Sequence[int],
    mesh: jax.sharding.Mesh,
    *,
    beam_size: int,
    alpha: float,
    batch_tokens: int | None = None,
    stats: dict | None = None,
) -> list[np.ndarray]:
  """The output tokens (EOS then PAD) of each token-id source (no EOS), in order: the one
  decoding path of every command and of training's evaluations, for every task.

  Sentences are sorted by length and batched by tokens (`decode_batches`), or, for a greedy
  search the predictor `refills`, searched whole in rows that finished ones leave (its own
  rows: `batch_tokens` does not apply); each
  sentence's output limit is its own (decode.py), so its output does not depend on the
  batch. `stats`, if given, is filled with what the decoding cost: batches, rows (filler
  included), decoder steps and row-steps (sentences decoded at each step, summed).
  """
  out: list[np.ndarray] = [np.zeros(0, np.int32)] * len(sources)
  batch_sharding = sharding.batch_sharding(mesh)
  rows_multiple = mesh.shape["data"] * mesh.shape["fsdp"]
  totals = {"batches": 0, "rows": 0, "steps": 0, "row_steps": 0}
  if isinstance(predictor, decode.Predictor) and predictor.refills(beam_size, mesh):
    out = predictor.refiller.search(
        params, sources, bucket_lengths, predictor.config.max_len, totals
    )
  else:
    for index, inputs in decode_batches(
        sources, bucket_lengths, batch_tokens or DEFAULT_BATCH_TOKENS, rows_multiple
    ):
      inputs_global = _to_global(batch_sharding, inputs)
      tokens, steps = predictor.search(
          params, inputs_global, alpha, beam_size, stats=totals, sentences=len(sources)
      )
      for row, i in enumerate(index):
        if i >= 0:
          out[i] = tokens[row]
      totals["batches"] += 1
      totals["rows"] += inputs.shape[0]
      totals["steps"] += steps
  if stats is not None:
    stats.update(totals)
  return out


def decode_batches(
    sources: Sequence[Sequence[int]],
    bucket_lengths: Sequence[int],
    batch_tokens: int,
    rows_multiple: int = 1,
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
  """(index [B], inputs [B, L]) batches of every source (ids + EOS), sorted by length.

  Sentences go in order of length (stable), so a batch's sentences need about as many decoding
  steps as each other. A batch is padded to the bucket L of its longest sentence and has
  B = batch_tokens // L rows (a multiple of `rows_multiple`): one shape per bucket, so one
  compiled search per bucket. A batch is closed when the next sentence would not fit the rows
  of its (longer) bucket. Rows beyond the batch's sentences (index -1) repeat its first
  sentence, so they finish when it does and never lengthen the search.
  """
  if batch_tokens < 1:
    raise errors.UserError(f"batch_tokens={batch_tokens} must be >= 1")
  lengths = np.fromiter(
      (min(len(s) + 1, bucket_lengths[-1]) for s in sources), np.int64, count=len(sources)
  )
  bucket_of = np.searchsorted(np.asarray(bucket_lengths), lengths)  # first bucket >= length
  order = np.argsort(lengths, kind="stable")

  def rows_for(bucket: int) -> int:
    rows = batch_tokens // bucket_lengths[bucket] // rows_multiple * rows_multiple
    return max(rows, rows_multiple)

  start = 0
  while start < len(order):
    end = start + 1
    while end < len(order) and end - start + 1 <= rows_for(bucket_of[order[end]]):
      end += 1
    index = order[start:end]
    bucket = int(bucket_of[index[-1]])
    length, rows = bucket_lengths[bucket], rows_for(bucket)
    inputs = np.full((rows, length), PAD_ID, np.int32)  # [B, L]
    for row, i in enumerate(index):
      ids = np.asarray(sources[i], np.int32)[: length - 1]  # [n]
      inputs[row, : len(ids)] = ids
      inputs[row, len(ids)] = EOS_ID
    inputs[len(index) :] = inputs[0]  # filler rows: a copy of the first sentence
    yield np.concatenate([index, np.full(rows - len(index), -1, index.dtype)]), inputs
    start = end


def _to_global(batch_sharding, inputs: np.ndarray) -> jax.Array:
  """Every process holds the whole batch; each gives its slice of rows."""
  rows = inputs.shape[0] // jax.process_count()
  start = jax.process_index() * rows
  return jax.make_array_from_process_local_data(batch_sharding, inputs[start : start + rows])


MODEL_FILE = "model.json"  # the classes of a run's model, written when it starts


def describe_model(model: nn.Module) -> dict:
  """The classes of `model` and of its attention layers (a variant's own: tasks/base.py)."""
  name = lambda cls: f"{cls.__module__}.{cls.__qualname__}"  # noqa: E731
  described = {"model": name(type(model))}
  if isinstance(getattr(model, "attention", None), type):
    described["attention"] = name(model.attention)
  return described


def write_model_description(workdir: str, model: nn.Module) -> None:
  """Records `describe_model(model)` in the workdir (the chief's), atomically."""

  def write(tmp):
    with open(tmp, "w") as f:
      json.dump(describe_model(model), f, indent=2)

  files.atomic_write(os.path.join(workdir, MODEL_FILE), write)


def check_model(workdir: str, model: nn.Module) -> None:
  """Refuses, in one line, to decode a run with another model than the one it trained: the
  task that builds its variant must be registered in this process (docs/changing_the_model.md).
  A run with no model.json (written before it existed) is not checked."""
  path = os.path.join(workdir, MODEL_FILE)
  if not os.path.exists(path):
    return
  trained, built = files.read_json(path), describe_model(model)
  if trained != built:
    raise errors.UserError(
        f"{workdir} trained {trained}, but its task builds {built} here: register the task "
        "that builds its model before loading it (docs/changing_the_model.md)"
    )


def load_run(
    workdir: str,
    which: str = "auto",
    beam_size: int | None = None,
    alpha: float | None = None,
    devices: Sequence[jax.Device] | None = None,
    shapes: str | None = None,
    overrides: dict[str, Any] | None = None,
) -> LoadedRun:
  """Config, vocabulary and parameters of the training run in `workdir`, ready to decode.

  `which`: "latest", a step number, "avg" (the averaged checkpoint, §6.1), or "auto" (what the
  run's final evaluation used; see `resolve_checkpoint`). `beam_size`/`alpha` override the run's
  eval settings (the defaults of `decode_*`), `shapes` its `eval.shapes` (batch_shapes.py)
  and `overrides` any other key (`load_config`).
  """
  config = load_config(workdir, beam_size, alpha, shapes, overrides)
  task = tasks.get(config.task)  # the run's task, resolved once and handed down
  try:
    tokenizer = pipeline.load_workdir_tokenizer(workdir)
  except (FileNotFoundError, ValueError) as e:
    raise errors.UserError(str(e)) from e
  model = task.build_model(config, tokenizer)
  check_model(workdir, model)
  mesh = sharding.make_mesh(config.mesh, devices)
  abstract = abstract_params(model, sharding.replicated(mesh))
  kind, step = resolve_checkpoint(workdir, which, config.train.average_last)
  if kind == "avg":
    try:
      params = checkpoint.load_averaged(workdir, abstract)
    except FileNotFoundError as e:
      raise errors.UserError(str(e)) from e
    label = f"average of steps {averaged_steps(workdir)}"
  else:
    params = restore_params(workdir, step, abstract)
    label = f"step {step}"
  predictor = run_predictor(config, task, model, tokenizer)
  return LoadedRun(config, task, tokenizer, model, params, label, predictor, mesh)


def run_predictor(config, task, model: nn.Module, tokenizer: Tokenizer) -> Any:
  """What decodes a run of `task`: the task's predictor, or the search (`eval_predictor`) over
  the run's model under the task's constraint."""
  return task.predictor(config, model, tokenizer) or eval_predictor(
      config, model, task.constraint(config, tokenizer)
  )


def eval_predictor(config, model: nn.Module, constraint: Any) -> decode.Predictor:
  """The search of a run's eval settings (output limit, beam, α, shapes) over `model` (the run's,
  `Task.build_model`; refused in one line if the searches cannot decode it: decoder.py) with
  `constraint` (the task's, tasks/base.py; None for none): the final evaluation's and the
  commands'."""
  if isinstance(model, TransformerConfig):  # the paper's Transformer of it
    model = Transformer(model)
  decoder.check_decodable(model)
  if config.eval.get("matmul_dtype"):  # a deviation for speed (config.py)
    model = model.clone(config=model.config.replace(matmul_dtype=config.eval.matmul_dtype))
  return decode.Predictor(
      model,
      config.eval.max_decode_extra,
      config.eval.beam_size,
      config.eval.alpha,
      shapes=config.eval.shapes,
      constraint=constraint,
      stop=config.eval.beam_stop,
      refill=batch_shapes.refills(config.eval.refill),
  )
