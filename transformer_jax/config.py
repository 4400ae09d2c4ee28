"""The experiment config schema (ml_collections) and its validation.

Config files in `configs/` start from `default_config()` and change what their experiment needs,
so every run has every key and a command-line override of a key that does not exist fails at
once (`lock_config=True`). `validate` checks values before any data is read or compiled.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import ml_collections

from transformer_jax import errors, files, tasks
from transformer_jax.decoding import batch_shapes
from transformer_jax.model.config import TransformerConfig
from transformer_jax.parallel import sharding, xla_flags

_placeholder = ml_collections.config_dict.placeholder


def default_config(task: str = "translation") -> ml_collections.ConfigDict:
  """Every key of a run's config: the generic sections, then the task's own section
  (`config.<task>`, for a task that has one; tasks/)."""
  c = ml_collections.ConfigDict()
  c.seed = 0
  # What the run learns: "translation", "parsing" (§6.3), or a task registered with tasks.register.
  c.task = task
  c.model = model_section()
  c.data = data_section()
  c.train = train_section()
  c.eval = eval_section()
  c.mesh = ml_collections.ConfigDict({"data": -1, "fsdp": 1, "tensor": 1})
  c.sharding_rules = "data_parallel"  # data_parallel | fsdp | tensor_parallel (sharding.RULES)

  c.distributed = distributed_section()

  # XLA compiler flags, added to XLA_FLAGS before JAX starts (flags already there win); see
  # transformer_jax/parallel/xla_flags.py. The default makes GPU matmuls cuBLAS calls, faster
  # than XLA's Triton GEMMs for the base and big train steps on an H100. "" = none.
  c.xla_flags = "--xla_gpu_enable_triton_gemm=false"
  section = tasks.get(task).config_section()
  if section is not None:
    c[task] = section
  return c


def model_section() -> ml_collections.ConfigDict:
  """config.model: the Transformer, named as in the paper; defaults are the base model (Table 3)."""
  s = ml_collections.ConfigDict()
  # Every key is a field of model.config.TransformerConfig, built as
  # TransformerConfig(vocab_size, **config.model).
  s.d_model = 512
  s.num_heads = 8
  s.key_dim = _placeholder(int)  # d_k per head; None = d_model / num_heads (§3.2.2)
  s.value_dim = _placeholder(int)  # d_v per head; None = d_model / num_heads
  s.num_layers = 6
  s.num_decoder_layers = _placeholder(int)  # None = same as num_layers
  s.d_ff = 2048
  s.dropout_rate = 0.1
  s.attention_dropout_rate = 0.0
  s.max_len = 256
  s.share_embeddings = True
  s.positional = "sinusoidal"  # §3.5; learned: Table 3 row (E)
  # K > 0 (a deviation, off by default): the encoder's attention adds a learned bias per head for
  # each key-query offset clipped to [-K, K] (model/config.py TransformerConfig).
  s.relative_positions = 0
  s.norm_position = "post"
  s.dtype = "float32"
  s.param_dtype = "float32"
  # The layers' matmuls (model/config.py `matmul_dtype`): None, in `dtype`; "bfloat16" (a
  # deviation, off by default) rounds their inputs, and in training their gradients, to bf16 and
  # sums in `dtype`: about 2x the matmul rate of float32 on a CPU with bf16 dot products
  # (docs/experiments.md). Decoding keeps it unless eval.matmul_dtype says otherwise.
  s.matmul_dtype = _placeholder(str)
  s.attention_impl = "auto"  # auto | xla | cudnn | einsum (auto: cuDNN fused on GPU bf16)
  s.remat_policy = "none"  # none | full | dots | dots_no_batch: recompute layers in backward
  s.scan_layers = False  # nn.scan over layers: compile time independent of depth
  return s


def data_section() -> ml_collections.ConfigDict:
  """config.data: the corpus, its vocabulary and the training batches (§5.1)."""
  s = ml_collections.ConfigDict()
  s.source = "synthetic"  # the task's sources: synthetic | text | tfds; ptb (§6.3 trees)
  s.path = ""  # text: directory with {split}.{lang} files; ptb: a tree directory
  # Prepared (tokenized, memory-mapped) corpora, data/prepared.py. "": `prepared/` beside the
  # workdir (shared storage on a cluster; sibling runs share it), or ~/.cache/transformer_jax/
  # prepared without a workdir.
  s.cache_dir = ""
  s.tfds_name = "wmt14_translate/de-en"
  s.tfds_data_dir = ""
  s.source_lang = "en"
  s.target_lang = "de"
  s.train_split = "train"
  s.eval_split = "valid"
  s.test_split = "test"
  s.vocab_size = 37000  # SentencePiece vocabulary (§5.1: shared ~37k for EN-DE)
  s.max_len = 128  # tokens per side, EOS/BOS included; longer pairs are truncated
  s.tokens_per_batch = 4096  # per update, summed over devices (§5.1: ~25k per side)
  s.bucket_step = 8  # bucket lengths are multiples of this (few jit shapes)
  s.num_buckets = 8  # padded lengths (jit shapes); more buckets = less padding
  # Pack several pairs into each row of max_len (segment ids and positions keep them apart)
  # instead of bucketing by length: one jit shape and almost no padding (batching.py).
  s.packing = False
  # With packing: the source side's rows hold this many positions, the target side's
  # data.max_len (0: max_len on both sides). For corpora whose targets are much longer than
  # their sources (a linearized tree is ~3.4 times its sentence), so that the encoder does not
  # run over mostly padding; sources longer than it are truncated (and counted).
  s.packed_source_len = 0
  # Rows of every training batch (per bucket, or packed) are a multiple of this, besides the
  # device count: a run may later resume on any device count that divides it (growth; shrinking
  # needs nothing). E.g. 8 on a CPU or one GPU, to move to a host of 8; 1 = no constraint.
  s.row_multiple = 1
  s.spm_max_sentences = 1_000_000  # SentencePiece trains on a random sample this big
  s.synthetic_seed = 0
  s.synthetic_train_size = 50_000
  s.synthetic_eval_size = 500
  return s


def train_section() -> ml_collections.ConfigDict:
  """config.train: steps, the optimizer and its schedule (§5.3), checkpoints, budgets."""
  s = ml_collections.ConfigDict()
  s.num_steps = 100_000  # base model: 100k steps (§5.2)
  s.warmup_steps = 4000  # §5.3
  s.label_smoothing = 0.1  # ε_ls, §5.4: of the training loss (and of the reported eval loss)
  s.lr_multiplier = 1.0
  # Not in the paper: the last cooldown_steps updates scale Eq. 3 linearly down to zero at
  # train.num_steps (0: Eq. 3 alone), for short fixed budgets of steps.
  s.cooldown_steps = 0
  s.adam_b1 = 0.9
  s.adam_b2 = 0.98
  s.adam_eps = 1e-9
  s.grad_clip_norm = 0.0  # 0 = off, as in the paper
  s.grad_accum_steps = 1
  s.log_every = 100
  s.checkpoint_every = 1000
  s.keep_checkpoints = 5
  s.eval_every = 0  # 0 = evaluate only at the end
  s.average_last = 0  # §6.1: final evaluation on the mean of the last N checkpoints; 0 = off
  # Not in the paper (which evaluates the last checkpoints): every `eval_every` updates, score the
  # mean of the last `average_last` checkpoints (0: the latest) on the whole validation split by
  # the task's metric, keep the best as the averaged checkpoint, and evaluate that one at the
  # end. A longer run can then only add candidates: more updates never choose a worse one on
  # validation. `patience` > 0: stop once that many such evaluations in a row found none better.
  s.select_on_validation = False
  s.patience = 0
  # Wall-clock budget for the run's training loop, summed across restarts (compilation,
  # periodic evaluation and checkpointing included; the final evaluation not). Each checkpoint
  # records the training time so far, so a run preempted after 20 minutes of a 60-minute budget
  # trains 40 more when resumed. Checked every `log_every` steps; when it is spent the run
  # checkpoints and stops early, before `num_steps`. 0 = no budget.
  s.max_train_minutes = 0.0
  return s


def eval_section() -> ml_collections.ConfigDict:
  """config.eval: evaluation during and after training, and the search's settings (§6.1)."""
  s = ml_collections.ConfigDict()
  s.batch_size = 64  # sentences per evaluation batch (the loss), summed over devices
  # Source tokens per decoding batch (rows = batch_tokens // padded length): the searches of the
  # evaluations and the commands (runs/inference.py; measured in benchmarks/decode.py).
  s.batch_tokens = 2048
  s.num_sentences = 500  # bounded validation subset for BLEU during training
  s.max_decode_extra = 50  # §6.1: maximum output length = input length + 50
  s.beam_size = 4  # §6.1; 1 = greedy
  s.alpha = 0.6  # §6.1 length penalty ((5 + |Y|) / 6)^α
  # When the beam search leaves a sentence (§6.1: "terminate early when possible"): "proven",
  # once no alive hypothesis can beat the best finished one (the result of searching to the
  # output limit); "k_finished", also once beam_size hypotheses have finished (CTranslate2's and
  # fairseq's rule; a deviation, off by default): faster, and a few translations differ (figures
  # in docs/translation.md).
  s.beam_stop = "proven"
  # The search's batch shapes (batch_shapes.py): "fast" decodes fastest once compiled; "few"
  # compiles ~5x fewer programs, so a first call on a new machine returns ~2x sooner; "auto":
  # "few" for calls of fewer than 2,000 sentences, "fast" from the first larger call on. The
  # same translations (on a GPU, all but a few near-ties: shapes change the order of sums).
  s.shapes = "auto"
  # Greedy search on one CPU device searches a whole call in rows that a finished sentence
  # leaves and the next joins (decoding/refill.py): the same translations. "auto": on the CPUs
  # where it measured faster than batches (batch_shapes.REFILL_FASTER_ON, docs/benchmarks.md);
  # "on": always; "off": in batches, as beam search.
  s.refill = "auto"
  # The encoder's and decoder's matmuls when decoding (model/config.py `matmul_dtype`): "" as the
  # model was trained (model.matmul_dtype, else its dtype); "bfloat16" (a deviation, off by
  # default) rounds their inputs to bf16 and sums in float32: faster on a CPU with bf16 dot
  # products, and some translations change (figures in docs/translation.md).
  s.matmul_dtype = ""
  return s


# The keys of config.eval that change what the search writes, which tune_decoding --try compares
# by the validation score (a task adds its own, tasks/base.py `Task.decoding_keys`). Not among
# them: beam_size and alpha, which tune_decoding sweeps with flags of their own; batch_tokens,
# shapes and refill, which change how fast the search runs and not its outputs; batch_size and
# num_sentences, which are the evaluation loss's and training's subset, not the search's.
DECODING_KEYS = ("beam_stop", "matmul_dtype", "max_decode_extra")


def decoding_keys(task) -> list[str]:
  """The "section.key" names of the decoding settings of a run of `task`: DECODING_KEYS and the
  task's own (`Task.decoding_keys`, keys of its section)."""
  return [f"eval.{k}" for k in DECODING_KEYS] + [
      f"{task.name}.{k}" for k in getattr(task, "decoding_keys", ())
  ]


def distributed_section() -> ml_collections.ConfigDict:
  """config.distributed: joining the processes of a multi-host run."""
  s = ml_collections.ConfigDict()
  # Multi-process runs (several hosts, or several GPUs with one process each): every process runs
  # the same command; `jax.distributed.initialize` joins them before any other JAX call. Leave
  # the three fields unset where JAX detects them (Cloud TPU VMs, SLURM, Open MPI, and
  # JAX_COORDINATOR_ADDRESS in the environment); see transformer_jax/parallel/distributed.py.
  s.enabled = False
  s.coordinator_address = ""  # "host:port" of process 0; "" = auto-detect
  s.num_processes = 0  # 0 = auto-detect
  s.process_id = -1  # -1 = auto-detect
  s.cpu_collectives = "gloo"  # CPU-only jobs: gloo | mpi (cross-process all-reduce)
  return s


def model_config(config: ml_collections.ConfigDict, vocab_size: int) -> TransformerConfig:
  """The Transformer `config.model` describes, over a vocabulary of `vocab_size` pieces: the
  paper's model, or the generic part of a task's own (tasks/base.py `Task.build_model`)."""
  # Not config.model's: the vocabulary's size and the modes.
  fields = {f.name for f in dataclasses.fields(TransformerConfig)} - {
      "vocab_size",
      "deterministic",
      "decode",
      "cache",
  }
  unknown = sorted(set(config.model) - fields)
  if unknown:
    raise ConfigError(
        f"config.model.{unknown[0]}: not a key of config.model (expected one of "
        f"{sorted(fields)}; the vocabulary comes from the run's data)"
    )
  return TransformerConfig(vocab_size=vocab_size, **config.model.to_dict())


# Keys of config.model no longer there (an experiment measured and not adopted): key ->
# (kept(value, model section) -> bool, what it was and the commit that has its code); as a
# task's `retired_keys` (tasks/base.py).
RETIRED_MODEL_KEYS = {
    "positional": (
        lambda value, section: value != "none",
        "positional='none' (an encoder that sees order through relative_positions alone): "
        "measured and not adopted, its code is at commit 3d33068",
    )
}


def from_saved(saved: dict) -> ml_collections.ConfigDict:
  """A run's config from its `config.json` (a dict), on top of today's defaults of its task: a
  key the run did not save takes its default value, a key saved where an older layout kept it
  moves to where it lives now (tasks.saved_layout), and a retired key (RETIRED_MODEL_KEYS, a
  task's `retired_keys`) is dropped where its value changes nothing, else refused."""
  saved = tasks.saved_layout(saved)  # a copy, its task named
  task = saved["task"]
  defaults = default_config(task)  # an unknown task: a UserError naming config.task
  for name, keys in (("model", RETIRED_MODEL_KEYS), (task, tasks.get(task).retired_keys)):
    section = saved.get(name, {})
    for key, (kept, what) in keys.items():
      if key in section and not kept(section[key], section):
        raise ConfigError(
            f"config.{name}.{key}={section[key]!r}: {what}; this code cannot run the saved run "
            "(check that commit out to use it)"
        )
      if key in section and key not in defaults[name]:  # a key no longer there: dropped
        section.pop(key)
  evaluation = saved.get("eval", {})
  if isinstance(evaluation.get("refill"), bool):  # saved before "auto": true was the default
    evaluation["refill"] = "auto" if evaluation["refill"] else "off"
  defaults.update(saved)
  return defaults


def load_saved(path: str, fix: str = files.DAMAGED) -> ml_collections.ConfigDict:
  """The config a run saved in `path` (its config.json), by `from_saved`.

  A file that is missing, damaged or cut short, or that holds JSON which is no run's config (a
  list, a section that is not an object, a value of another type than the key's), is one
  UserError naming `path`, then `fix`.
  """
  saved = files.read_json(path, dict, fix=fix)
  try:
    return from_saved(saved)
  except errors.UserError as e:
    raise ConfigError(f"{path}: {e}") from None
  except (TypeError, ValueError, AttributeError, KeyError) as e:
    reason = " ".join(str(e).split())
    raise ConfigError(f"{path} does not hold a run's config ({reason}): {fix}") from None


class ConfigError(errors.UserError):
  """A config value is wrong; the message names the key."""


Check = Callable[[bool, str, str], None]  # check(ok, "section.key", message)


def checker(config: ml_collections.ConfigDict) -> Check:
  """`check(ok, key, message)`: a ConfigError naming `config.key` and its value unless ok."""

  def check(ok: bool, key: str, message: str):
    if not ok:
      raise ConfigError(f"config.{key}={config_value(config, key)!r}: {message}")

  return check


def validate(config: ml_collections.ConfigDict, task=None) -> None:
  """Fails fast, naming the key, on values no run could use. Called before any compute. Each
  section has its checks; the task (the run's, resolved where it starts; None: `config.task`'s)
  checks its own section and what it needs of the others."""
  check = checker(config)
  if task is None:
    names = tasks.names()
    check(config.task in names, "task", f"expected one of {names} (or a task registered first)")
    task = tasks.get(config.task)
  # A config made for another task (its file given --config.task=NAME) lacks this task's
  # section, which the checks below read.
  if task.config_section() is not None and not isinstance(
      config.get(task.name), ml_collections.ConfigDict
  ):
    raise ConfigError(
        f"config.task={config.task!r}: this config has no config.{task.name} section (it was "
        f"not made for the {task.name} task); use a config file of that task, or build the "
        f"config from default_config({task.name!r})"
    )
  validate_model(config)
  validate_data(config, check, task.sources)
  validate_train(config, check)
  validate_eval(config, check)
  validate_devices(config, check)
  task.validate(config, check)


def validate_model(config: ml_collections.ConfigDict) -> None:
  # The model's own checks, with a placeholder vocabulary.
  try:
    model_config(config, vocab_size=64)
  except ConfigError:
    raise
  except (TypeError, ValueError) as e:  # TypeError: a None where the field needs a number
    raise ConfigError(f"config.model: {e}") from e


def validate_data(config: ml_collections.ConfigDict, check: Check, sources: tuple) -> None:
  d = config.data
  check(d.source in sources, "data.source", f"the {config.task} task reads one of {sources}")
  if d.source == "text":
    check(bool(d.path), "data.path", "the text source needs a directory of parallel files")
    check(os.path.isdir(d.path), "data.path", "is not a directory")
  if d.source == "tfds":
    check(bool(d.tfds_name), "data.tfds_name", "the tfds source needs a dataset name")
  check(d.max_len >= 2, "data.max_len", "must be >= 2 (a token plus EOS)")
  check(
      d.max_len <= config.model.max_len,
      "data.max_len",
      f"exceeds model.max_len={config.model.max_len}, the positional table's length",
  )
  if d.cache_dir:  # a directory for prepared corpora, made if missing; a file in the way fails
    try:
      files.check_directory(d.cache_dir, "config.data.cache_dir")
    except errors.UserError as e:
      raise ConfigError(
          f"{e}; give a directory for prepared corpora (or '' for the default)"
      ) from None
  check(d.bucket_step >= 1, "data.bucket_step", "must be >= 1")
  check(d.num_buckets >= 1, "data.num_buckets", "must be >= 1")
  check(d.row_multiple >= 1, "data.row_multiple", "must be >= 1 (1 = no constraint)")
  check(
      d.tokens_per_batch >= d.row_multiple * d.max_len,
      "data.tokens_per_batch",
      f"must hold data.row_multiple={d.row_multiple} rows of data.max_len={d.max_len} tokens",
  )
  check(
      d.packed_source_len == 0 or (d.packing and 2 <= d.packed_source_len <= d.max_len),
      "data.packed_source_len",
      f"must be 0, or in [2, data.max_len={d.max_len}] with data.packing=True",
  )
  check(d.spm_max_sentences >= 1, "data.spm_max_sentences", "must be >= 1")
  check(
      d.tokens_per_batch >= d.max_len,
      "data.tokens_per_batch",
      f"must hold at least one sequence of data.max_len={d.max_len} tokens",
  )
  check(d.vocab_size >= 8, "data.vocab_size", "must be >= 8")


def validate_train(config: ml_collections.ConfigDict, check: Check) -> None:
  t = config.train
  check(t.num_steps >= 1, "train.num_steps", "must be >= 1")
  check(t.warmup_steps >= 1, "train.warmup_steps", "must be >= 1")
  check(t.lr_multiplier > 0, "train.lr_multiplier", "must be > 0")
  check(0 <= t.label_smoothing < 1, "train.label_smoothing", "must be in [0, 1)")
  check(
      0 <= t.cooldown_steps <= t.num_steps,
      "train.cooldown_steps",
      f"must be in [0, train.num_steps={t.num_steps}]",
  )
  check(0 <= t.adam_b1 < 1, "train.adam_b1", "must be in [0, 1)")
  check(0 <= t.adam_b2 < 1, "train.adam_b2", "must be in [0, 1)")
  check(t.adam_eps > 0, "train.adam_eps", "must be > 0")
  check(t.grad_clip_norm >= 0, "train.grad_clip_norm", "must be >= 0 (0 = off)")
  check(t.grad_accum_steps >= 1, "train.grad_accum_steps", "must be >= 1")
  check(t.log_every >= 1, "train.log_every", "must be >= 1")
  check(t.checkpoint_every >= 1, "train.checkpoint_every", "must be >= 1")
  check(t.keep_checkpoints >= 1, "train.keep_checkpoints", "must be >= 1")
  check(t.eval_every >= 0, "train.eval_every", "must be >= 0 (0 = only at the end)")
  check(
      0 <= t.average_last <= t.keep_checkpoints,
      "train.average_last",
      f"must be in [0, train.keep_checkpoints={t.keep_checkpoints}]: only kept checkpoints average",
  )
  check(t.max_train_minutes >= 0, "train.max_train_minutes", "must be >= 0 (0 = no budget)")
  check(t.patience >= 0, "train.patience", "must be >= 0 (0 = train to the end)")
  if t.select_on_validation or t.patience:
    check(
        t.select_on_validation,
        "train.patience",
        "counts evaluations of train.select_on_validation: set it too",
    )
    check(
        t.eval_every > 0 and t.eval_every % t.checkpoint_every == 0,
        "train.select_on_validation",
        f"scores checkpoints every train.eval_every updates: that must be a positive multiple of "
        f"train.checkpoint_every={t.checkpoint_every} (it is {t.eval_every})",
    )


def validate_eval(config: ml_collections.ConfigDict, check: Check) -> None:
  e = config.eval
  check(e.batch_size >= 1, "eval.batch_size", "must be >= 1")
  check(e.batch_tokens >= 1, "eval.batch_tokens", "must be >= 1")
  check(e.num_sentences >= 1, "eval.num_sentences", "must be >= 1")
  check(e.max_decode_extra >= 1, "eval.max_decode_extra", "must be >= 1")
  check(e.beam_size >= 1, "eval.beam_size", "must be >= 1 (1 = greedy)")
  check(e.alpha >= 0, "eval.alpha", "must be >= 0")
  check(e.shapes in batch_shapes.NAMES, "eval.shapes", f"must be one of {batch_shapes.NAMES}")
  check(e.beam_stop in batch_shapes.STOPS, "eval.beam_stop", f"must be one of {batch_shapes.STOPS}")
  check(e.refill in batch_shapes.REFILLS, "eval.refill", f"must be one of {batch_shapes.REFILLS}")
  check(
      e.matmul_dtype in ("", "bfloat16", "float32"),
      "eval.matmul_dtype",
      "must be '' (the model's dtype), 'bfloat16' or 'float32'",
  )


def validate_devices(config: ml_collections.ConfigDict, check: Check) -> None:
  """The mesh, its sharding rules, the processes of a multi-host run and XLA's flags."""
  for axis in config.mesh:
    check(
        config.mesh[axis] == -1 or config.mesh[axis] >= 1,
        f"mesh.{axis}",
        "must be a positive size or -1 (fill with the remaining devices)",
    )
  check(
      config.sharding_rules in sharding.RULES,
      "sharding_rules",
      f"expected one of {sorted(sharding.RULES)}",
  )
  dist = config.distributed
  check(dist.num_processes >= 0, "distributed.num_processes", "must be >= 0 (0 = auto-detect)")
  check(dist.process_id >= -1, "distributed.process_id", "must be >= 0, or -1 to auto-detect")
  if dist.num_processes and dist.process_id >= 0:
    check(
        dist.process_id < dist.num_processes,
        "distributed.process_id",
        f"must be < distributed.num_processes={dist.num_processes}",
    )
  if dist.coordinator_address:
    check(
        ":" in dist.coordinator_address,
        "distributed.coordinator_address",
        "expected host:port (process 0's address and a free port)",
    )
  check(
      dist.cpu_collectives in ("gloo", "mpi"),
      "distributed.cpu_collectives",
      "expected 'gloo' or 'mpi'",
  )
  try:
    xla_flags.parse(config.xla_flags)
  except ValueError as e:
    raise ConfigError(f"config.xla_flags={config.xla_flags!r}: {e}") from e


def config_value(config: ml_collections.ConfigDict, dotted: str):
  value = config
  for part in dotted.split("."):
    value = value[part]
  return value
