"""The experiment config schema (ml_collections) and its validation.

Config files in `configs/` start from `default_config()` and change what their experiment needs,
so every run has every key and a command-line override of a key that does not exist fails at
once (`lock_config=True`). `validate` checks values before any data is read or compiled.
"""

from __future__ import annotations

import dataclasses
import os

import ml_collections

from transformer_jax import batch_shapes, cli, errors, sharding, xla_flags
from transformer_jax.model_config import TransformerConfig

SOURCES = ("synthetic", "text", "tfds", "ptb")


def default_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0

  # The model, named as in the paper; defaults are the base model (Table 3). Every key is a field
  # of model_config.TransformerConfig, built as TransformerConfig(vocab_size, **config.model).
  placeholder = ml_collections.config_dict.placeholder
  c.model = ml_collections.ConfigDict()
  c.model.d_model = 512
  c.model.num_heads = 8
  c.model.key_dim = placeholder(int)  # d_k per head; None = d_model / num_heads (§3.2.2)
  c.model.value_dim = placeholder(int)  # d_v per head; None = d_model / num_heads
  c.model.num_layers = 6
  c.model.num_decoder_layers = placeholder(int)  # None = same as num_layers
  c.model.d_ff = 2048
  c.model.dropout_rate = 0.1
  c.model.attention_dropout_rate = 0.0
  c.model.max_len = 256
  c.model.share_embeddings = True
  c.model.positional = "sinusoidal"
  c.model.norm_position = "post"
  c.model.dtype = "float32"
  c.model.param_dtype = "float32"
  c.model.attention_impl = "auto"  # auto | xla | cudnn | einsum (auto: cuDNN fused on GPU bf16)
  c.model.remat_policy = "none"  # none | full | dots | dots_no_batch: recompute layers in backward
  c.model.scan_layers = False  # nn.scan over layers: compile time independent of depth

  c.data = ml_collections.ConfigDict()
  c.data.source = "synthetic"  # synthetic | text | tfds | ptb
  c.data.path = ""  # text: directory with {split}.{lang} files; ptb: a tree directory
  # Prepared (tokenized, memory-mapped) corpora, data/prepared.py. "": `prepared/` beside the
  # workdir (shared storage on a cluster; sibling runs share it), or ~/.cache/transformer_jax/
  # prepared without a workdir.
  c.data.cache_dir = ""
  c.data.tfds_name = "wmt14_translate/de-en"
  c.data.tfds_data_dir = ""
  c.data.source_lang = "en"
  c.data.target_lang = "de"
  c.data.train_split = "train"
  c.data.eval_split = "valid"
  c.data.test_split = "test"
  c.data.vocab_size = 37000  # SentencePiece vocabulary (§5.1: shared ~37k for EN-DE)
  c.data.max_len = 128  # tokens per side, EOS/BOS included; longer pairs are truncated
  c.data.tokens_per_batch = 4096  # per update, summed over devices (§5.1: ~25k per side)
  c.data.bucket_step = 8  # bucket lengths are multiples of this (few jit shapes)
  c.data.num_buckets = 8  # padded lengths (jit shapes); more buckets = less padding
  # Pack several pairs into each row of max_len (segment ids and positions keep them apart)
  # instead of bucketing by length: one jit shape and almost no padding (batching.py).
  c.data.packing = False
  # With packing: the source side's rows hold this many positions, the target side's
  # data.max_len (0: max_len on both sides). For corpora whose targets are much longer than
  # their sources (a linearized tree is ~3.4 times its sentence), so that the encoder does not
  # run over mostly padding; sources longer than it are truncated (and counted).
  c.data.packed_source_len = 0
  # Rows of every training batch (per bucket, or packed) are a multiple of this, besides the
  # device count: a run may later resume on any device count that divides it (growth; shrinking
  # needs nothing). E.g. 8 on a CPU or one GPU, to move to a host of 8; 1 = no constraint.
  c.data.row_multiple = 1
  c.data.spm_max_sentences = 1_000_000  # SentencePiece trains on a random sample this big
  # ptb (§6.3 parsing, data/trees.py): closing brackets of the linearized trees carry their
  # label, ")NP", as in Vinyals et al. (2015) ("labeled"), or are a bare ")" ("bare").
  c.data.tree_closing = "labeled"
  # ptb: True writes each word before its tag in the target ("(NP Mr. (NNP) Vinken (NNP) )NP"):
  # a deviation from Vinyals et al. (2015) and §6.3, whose targets hold no words; the written
  # words mark the decoder's position in the sentence (data/trees.py). Off: the paper's form.
  c.data.tree_words = False
  # ptb: "top_down" writes each phrase's opening before its words (Vinyals et al. 2015, §6.3);
  # "in_order" after its first child (Liu & Zhang 2017's in-order order; a deviation, off by
  # default): "(NNP) (NP (NNP) )NP (S ..." (data/trees.py).
  c.data.tree_order = "top_down"
  # ptb: in each training batch, each vocabulary word is read as its unknown-word class with this
  # probability, in source and target alike (word dropout, a deviation, off by default;
  # data/ptb.py).
  c.data.word_dropout = 0.0
  c.data.synthetic_seed = 0
  c.data.synthetic_train_size = 50_000
  c.data.synthetic_eval_size = 500

  c.train = ml_collections.ConfigDict()
  c.train.num_steps = 100_000  # base model: 100k steps (§5.2)
  c.train.warmup_steps = 4000  # §5.3
  c.train.label_smoothing = 0.1  # ε_ls, §5.4: of the training loss (and of the reported eval loss)
  c.train.lr_multiplier = 1.0
  # "exact" (the paper): every target token is scored. "any" (a deviation; ptb runs with
  # data.tree_words): a target word is scored as "a word comes here", its probability the sum
  # over the vocabulary's words, since the decoding constraint dictates which (losses.py).
  c.train.word_loss = "exact"
  # Not in the paper: the last cooldown_steps updates scale Eq. 3 linearly down to zero at
  # train.num_steps (0: Eq. 3 alone), for short fixed budgets of steps.
  c.train.cooldown_steps = 0
  c.train.adam_b1 = 0.9
  c.train.adam_b2 = 0.98
  c.train.adam_eps = 1e-9
  c.train.grad_clip_norm = 0.0  # 0 = off, as in the paper
  c.train.grad_accum_steps = 1
  c.train.log_every = 100
  c.train.checkpoint_every = 1000
  c.train.keep_checkpoints = 5
  c.train.eval_every = 0  # 0 = evaluate only at the end
  c.train.average_last = 0  # §6.1: final evaluation on the mean of the last N checkpoints; 0 = off
  # Wall-clock budget for the run's training loop, summed across restarts (compilation,
  # periodic evaluation and checkpointing included; the final evaluation not). Each checkpoint
  # records the training time so far, so a run preempted after 20 minutes of a 60-minute budget
  # trains 40 more when resumed. Checked every `log_every` steps; when it is spent the run
  # checkpoints and stops early, before `num_steps`. 0 = no budget.
  c.train.max_train_minutes = 0.0

  c.eval = ml_collections.ConfigDict()
  c.eval.batch_size = 64  # sentences per evaluation batch, summed over devices
  c.eval.num_sentences = 500  # bounded validation subset for BLEU during training
  c.eval.max_decode_extra = 50  # §6.1: maximum output length = input length + 50
  c.eval.beam_size = 4  # §6.1; 1 = greedy
  c.eval.alpha = 0.6  # §6.1 length penalty ((5 + |Y|) / 6)^α
  # The search's batch shapes (batch_shapes.py): "fast" decodes fastest once compiled; "few"
  # compiles ~5x fewer programs, so a first call on a new machine returns ~2x sooner; "auto":
  # "few" for calls of fewer than 2,000 sentences, "fast" from the first larger call on. The
  # same translations (on a GPU, all but a few near-ties: shapes change the order of sums).
  c.eval.shapes = "auto"
  # Parsing runs (data.source "ptb") only: the search writes only well-formed trees over the
  # input's words (tree_constraint.py). Not in the paper (§6.3 decodes freely): off by default.
  c.eval.tree_constraints = False

  c.mesh = ml_collections.ConfigDict({"data": -1, "fsdp": 1, "tensor": 1})
  c.sharding_rules = "data_parallel"  # data_parallel | fsdp | tensor_parallel (sharding.RULES)

  # Multi-process runs (several hosts, or several GPUs with one process each): every process runs
  # the same command; `jax.distributed.initialize` joins them before any other JAX call. Leave
  # the three fields unset where JAX detects them (Cloud TPU VMs, SLURM, Open MPI, and
  # JAX_COORDINATOR_ADDRESS in the environment); see transformer_jax/distributed.py.
  c.distributed = ml_collections.ConfigDict()
  c.distributed.enabled = False
  c.distributed.coordinator_address = ""  # "host:port" of process 0; "" = auto-detect
  c.distributed.num_processes = 0  # 0 = auto-detect
  c.distributed.process_id = -1  # -1 = auto-detect
  c.distributed.cpu_collectives = "gloo"  # CPU-only jobs: gloo | mpi (cross-process all-reduce)

  # XLA compiler flags, added to XLA_FLAGS before JAX starts (flags already there win); see
  # transformer_jax/xla_flags.py. The default makes GPU matmuls cuBLAS calls, faster than XLA's
  # Triton GEMMs for the base and big train steps on an H100. "" = none.
  c.xla_flags = "--xla_gpu_enable_triton_gemm=false"
  return c


def model_config(config: ml_collections.ConfigDict, vocab_size: int) -> TransformerConfig:
  """The model `config.model` describes, over a vocabulary of `vocab_size` pieces."""
  fields = {f.name for f in dataclasses.fields(TransformerConfig)}
  unknown = sorted(set(config.model) - fields)
  if unknown:
    raise ConfigError(
        f"config.model.{unknown[0]}: not a field of model_config.TransformerConfig "
        f"(expected one of {sorted(fields - {'vocab_size', 'deterministic', 'decode'})})"
    )
  return TransformerConfig(vocab_size=vocab_size, **config.model.to_dict())


def from_saved(saved: dict) -> ml_collections.ConfigDict:
  """A run's config from its `config.json` (a dict), on top of today's defaults: a key the run
  did not save takes its default value."""
  config = default_config()
  config.update(saved)
  return config


class ConfigError(errors.UserError):
  """A config value is wrong; the message names the key."""


def validate(config: ml_collections.ConfigDict) -> None:
  """Fails fast, naming the key, on values no run could use. Called before any compute."""

  def check(ok: bool, key: str, message: str):
    if not ok:
      raise ConfigError(f"config.{key}={config_value(config, key)!r}: {message}")

  try:
    model_config(config, vocab_size=64)  # the model's own checks, with a placeholder vocab
  except ConfigError:
    raise
  except (TypeError, ValueError) as e:  # TypeError: a None where the field needs a number
    raise ConfigError(f"config.model: {e}") from e
  try:
    xla_flags.parse(config.xla_flags)
  except ValueError as e:
    raise ConfigError(f"config.xla_flags={config.xla_flags!r}: {e}") from e
  d, t, e = config.data, config.train, config.eval
  check(d.source in SOURCES, "data.source", f"expected one of {SOURCES}")
  if d.source == "text":
    check(bool(d.path), "data.path", "the text source needs a directory of parallel files")
    check(os.path.isdir(d.path), "data.path", "is not a directory")
  if d.source == "ptb":  # whether it exists is checked when it is read: parsing needs no trees
    check(bool(d.path), "data.path", "the ptb source needs a directory of .mrg tree files")
  check(d.tree_closing in ("labeled", "bare"), "data.tree_closing", "expected 'labeled' or 'bare'")
  check(
      d.tree_order in ("top_down", "in_order"),
      "data.tree_order",
      "expected 'top_down' or 'in_order'",
  )
  check(0.0 <= d.word_dropout < 1.0, "data.word_dropout", "must be in [0, 1)")
  check(
      config.train.word_loss in ("exact", "any"),
      "train.word_loss",
      f"{config.train.word_loss!r}: expected 'exact' or 'any'",
  )
  check(
      config.train.word_loss == "exact" or (d.source == "ptb" and d.tree_words),
      "train.word_loss",
      "'any' scores the words a parsing target writes: ptb runs with data.tree_words=True only",
  )
  check(
      d.word_dropout == 0.0 or d.source == "ptb",
      "data.word_dropout",
      "word dropout reads words as the ptb source's unknown-word classes: ptb runs only",
  )
  check(d.max_len >= 2, "data.max_len", "must be >= 2 (a token plus EOS)")
  check(
      d.max_len <= config.model.max_len,
      "data.max_len",
      f"exceeds model.max_len={config.model.max_len}, the positional table's length",
  )
  if d.cache_dir:  # a directory for prepared corpora, made if missing; a file in the way fails
    try:
      cli.check_directory(d.cache_dir, "config.data.cache_dir")
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
  if d.source == "tfds":
    check(bool(d.tfds_name), "data.tfds_name", "the tfds source needs a dataset name")
  check(
      d.tokens_per_batch >= d.max_len,
      "data.tokens_per_batch",
      f"must hold at least one sequence of data.max_len={d.max_len} tokens",
  )
  check(d.vocab_size >= 8, "data.vocab_size", "must be >= 8")
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
  check(e.batch_size >= 1, "eval.batch_size", "must be >= 1")
  check(e.num_sentences >= 1, "eval.num_sentences", "must be >= 1")
  check(e.max_decode_extra >= 1, "eval.max_decode_extra", "must be >= 1")
  check(e.beam_size >= 1, "eval.beam_size", "must be >= 1 (1 = greedy)")
  check(e.alpha >= 0, "eval.alpha", "must be >= 0")
  check(e.shapes in batch_shapes.NAMES, "eval.shapes", f"must be one of {batch_shapes.NAMES}")
  check(
      not e.tree_constraints or config.data.source == "ptb",
      "eval.tree_constraints",
      "applies to parsing runs only (data.source='ptb')",
  )
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


def config_value(config: ml_collections.ConfigDict, dotted: str):
  value = config
  for part in dotted.split("."):
    value = value[part]
  return value
