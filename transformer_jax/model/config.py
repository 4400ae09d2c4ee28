"""The model's hyperparameters (`TransformerConfig`) and the names they take.

This module imports no Flax: attention.py and model.py both read it, config.py validates against
it, and none of them needs the others to know what a model is. Its fields are the keys of
`config.model` (transformer_jax/config.py), which builds it as
`TransformerConfig(vocab_size, **config.model)`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

# Token id 0 is padding everywhere (masked out of attention and of the loss); the tokenizers
# (data/tokenizer.py) give it the same id.
PAD_ID = 0
BOS_ID = 2  # the decoder's first input (incremental.py); the tokenizers' BOS
# Character ids of a source token's spelling (`TransformerConfig.source_chars`): 1..255, 0 none.
CHAR_VOCAB = 256
CHAR_DIM = 32  # the width of a character's embedding (transformer.py SpellingFeatures)
# Ids of a source token's hashed affixes (`TransformerConfig.source_affixes`): 1..AFFIX_BUCKETS-1,
# 0 none (a task computes them: tasks/base.py Task.source_affixes).
AFFIX_BUCKETS = 16384  # room for a few thousand affixes with few collisions

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}

# How attention runs (attention.py): auto | xla | cudnn | einsum.
ATTENTION_IMPLS = ("auto", "xla", "cudnn", "einsum")

# What a rematerialised layer keeps from its forward pass (model.py maps each name to a JAX policy):
#   none           no rematerialisation
#   full           keep only the layer's inputs
#   dots           keep every matmul output
#   dots_no_batch  keep the weight matmuls (projections, FFN), recompute attention scores [b,h,q,k]
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch")


def as_dtype(dtype: Any) -> Any:
  """Accepts a jnp dtype or its name ("bfloat16"), so configs can stay plain strings."""
  if isinstance(dtype, str):
    if dtype not in DTYPES:
      raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPES)}")
    return DTYPES[dtype]
  return dtype


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Hyperparameters, named as in the paper. Defaults are the base model (Table 3, row 'base').

  Modes are made with `.replace(...)`: `deterministic=True` for evaluation (no dropout) and
  `decode=True` for step-by-step decoding with a KV cache.
  """

  vocab_size: int
  d_model: int = 512
  num_heads: int = 8  # h
  # §3.2.2: d_k = d_v = d_model / h by default (None). Table 3 row (A) varies h with
  # d_k = d_v = d_model / h; row (B) shrinks d_k alone (16, 32) with d_v = 64.
  key_dim: int | None = None  # d_k, the query/key size per head
  value_dim: int | None = None  # d_v, the value size per head
  num_layers: int = 6  # N, encoder layers
  num_decoder_layers: int | None = None  # None = num_layers
  d_ff: int = 2048
  dropout_rate: float = 0.1  # P_drop, §5.4
  attention_dropout_rate: float = 0.0  # not used by the paper
  max_len: int = 256  # longest sequence the positional table covers
  share_embeddings: bool = True  # §3.4: one matrix for both embeddings and the pre-softmax layer
  # 0 (the paper): the decoder scores every vocabulary id. N > 0 (a task's deviation, set from
  # its vocabulary, never by hand: tasks/base.py Task.output_tokens, config.run_model_config):
  # logits [..., N + 1], ids 0..N-1 one by one and one more output, "any other token", with its
  # own weights.
  output_tokens: int = 0
  # 0 (the paper): a source token is its id, inputs [b, s]. C > 0 (a task's deviation, set by the
  # task, never by hand: tasks/base.py Task.source_chars): inputs [b, s, 1 + C], each token's id
  # and then C character ids of its spelling (CHAR_VOCAB), whose features are added to its
  # embedding (transformer.py SpellingFeatures).
  source_chars: int = 0
  # False: those C ids are characters (CHAR_VOCAB), concatenated in their order and read by a
  # feed-forward network (SpellingFeatures). True (a task's deviation, set by the task, never by
  # hand: Task.source_affixes): they are hashed affixes (AFFIX_BUCKETS), each embedded and summed
  # (transformer.py AffixFeatures).
  source_affixes: bool = False
  # 0 (the paper): the encoder's output feeds the decoder. L > 0 (a task's deviation, set by the
  # task, never by hand: tasks/base.py Task.chart_model): no decoder; a span chart over the
  # encoder's output scores each span's L labels and each token's `chart_tags` tags
  # (transformer.py SpanChart; Kitaev & Klein 2018's chart parser).
  chart_labels: int = 0
  chart_tags: int = 0
  chart_hidden: int = 256  # the span classifier's hidden units (SpanChart)
  # What the chart's scores are: each span's label's log-probability ("spans") or a tree
  # potential ("tree"); training/losses.py chart_cross_entropy.
  chart_loss: str = "spans"
  positional: str = "sinusoidal"  # §3.5; "learned" is Table 3 row (E); "none": see below
  # 0 (the paper): order reaches the model only through `positional`. K > 0 (a deviation, off by
  # default): the encoder's self-attention also adds to each head's logits a learned scalar for the
  # key's offset from the query, clipped to [-K, K] (Shaw et al. 2018's clipping; one table for all
  # layers, as in Raffel et al. 2020's T5). With `positional="none"` the encoder sees order through
  # these alone (a model without a decoder only: the decoder would have none).
  relative_positions: int = 0
  norm_position: str = "post"  # "post": LayerNorm(x + Sublayer(x)) as in §3.1; "pre": pre-LN
  layer_norm_epsilon: float = 1e-6
  dtype: Any = jnp.float32  # compute dtype; bfloat16 for mixed precision
  param_dtype: Any = jnp.float32
  attention_impl: str = "auto"  # one of ATTENTION_IMPLS; see attention.py
  remat_policy: str = "none"  # one of REMAT_POLICIES
  scan_layers: bool = False  # nn.scan over layers; parameters stacked on a leading axis
  deterministic: bool = False
  decode: bool = False

  def __post_init__(self):
    # Dataclass is frozen; normalise dtype names through object.__setattr__.
    object.__setattr__(self, "dtype", as_dtype(self.dtype))
    object.__setattr__(self, "param_dtype", as_dtype(self.param_dtype))
    checks = [
        (self.vocab_size > 0, "vocab_size must be positive"),
        (self.d_model > 0 and self.num_heads > 0, "d_model and num_heads must be positive"),
        (
            (self.key_dim is not None and self.value_dim is not None)
            or self.d_model % max(self.num_heads, 1) == 0,
            f"d_model={self.d_model} must be divisible by num_heads={self.num_heads} "
            "(or set key_dim and value_dim)",
        ),
        (
            all(d is None or d > 0 for d in (self.key_dim, self.value_dim)),
            f"key_dim={self.key_dim} and value_dim={self.value_dim} must be positive or None",
        ),
        (self.num_layers >= 1, f"num_layers={self.num_layers} must be >= 1"),
        (
            self.num_decoder_layers is None or self.num_decoder_layers >= 1,
            f"num_decoder_layers={self.num_decoder_layers} must be >= 1 or None",
        ),
        (self.d_ff > 0, f"d_ff={self.d_ff} must be positive"),
        (0.0 <= self.dropout_rate < 1.0, f"dropout_rate={self.dropout_rate} not in [0, 1)"),
        (
            0.0 <= self.attention_dropout_rate < 1.0,
            f"attention_dropout_rate={self.attention_dropout_rate} not in [0, 1)",
        ),
        (self.max_len > 0, f"max_len={self.max_len} must be positive"),
        (
            0 <= self.output_tokens < self.vocab_size,
            f"output_tokens={self.output_tokens} not in [0, vocab_size={self.vocab_size})",
        ),
        (self.source_chars >= 0, f"source_chars={self.source_chars} must be >= 0"),
        (
            self.source_chars > 0 or not self.source_affixes,
            "source_affixes=True reads the source_chars ids as affixes: set source_chars > 0",
        ),
        (
            (self.chart_labels == 0) == (self.chart_tags == 0) and self.chart_labels >= 0,
            f"chart_labels={self.chart_labels} and chart_tags={self.chart_tags}: both 0 (a "
            "decoder) or both positive (a span chart)",
        ),
        (self.chart_hidden > 0, f"chart_hidden={self.chart_hidden} must be positive"),
        (
            self.chart_loss in ("spans", "tree"),
            f"chart_loss={self.chart_loss!r}; expected 'spans' or 'tree'",
        ),
        (
            self.positional in ("sinusoidal", "learned", "none"),
            f"positional={self.positional!r}; expected 'sinusoidal', 'learned' or 'none'",
        ),
        (
            self.relative_positions >= 0,
            f"relative_positions={self.relative_positions} must be >= 0 (0: none)",
        ),
        (
            self.positional != "none" or (self.relative_positions > 0 and self.chart_labels > 0),
            "positional='none' leaves the model no order but relative_positions, which only the "
            "encoder reads: set relative_positions > 0, for a model without a decoder",
        ),
        (
            self.norm_position in ("post", "pre"),
            f"norm_position={self.norm_position!r}; expected 'post' or 'pre'",
        ),
        (
            self.positional != "sinusoidal" or self.d_model % 2 == 0,
            f"sinusoidal positions need an even d_model, got {self.d_model}",
        ),
        (
            self.attention_impl in ATTENTION_IMPLS,
            f"attention_impl={self.attention_impl!r}; expected one of {ATTENTION_IMPLS}",
        ),
        (
            self.remat_policy in REMAT_POLICIES,
            f"remat_policy={self.remat_policy!r}; expected one of {REMAT_POLICIES}",
        ),
    ]
    for ok, message in checks:
      if not ok:
        raise ValueError(f"TransformerConfig: {message}")

  @property
  def head_key_dim(self) -> int:
    """d_k: per-head query/key size (§3.2.2: d_model / h unless `key_dim` is set)."""
    return self.key_dim if self.key_dim is not None else self.d_model // self.num_heads

  @property
  def head_value_dim(self) -> int:
    """d_v: per-head value size (§3.2.2: d_model / h unless `value_dim` is set)."""
    return self.value_dim if self.value_dim is not None else self.d_model // self.num_heads

  @property
  def decoder_layers(self) -> int:
    return self.num_layers if self.num_decoder_layers is None else self.num_decoder_layers

  @property
  def num_outputs(self) -> int:
    """The decoder's logits per position: the vocabulary, or `output_tokens` + 1."""
    return self.output_tokens + 1 if self.output_tokens else self.vocab_size

  def dummy_inputs(self, rows: int = 1, length: int = 8):
    """PAD inputs of the shape this model reads ([rows, length], or [rows, length, 1 + C] with
    `source_chars` C): what `init` traces."""
    shape = (rows, length) + ((1 + self.source_chars,) if self.source_chars else ())
    return jnp.zeros(shape, jnp.int32)

  def replace(self, **changes) -> TransformerConfig:
    return dataclasses.replace(self, **changes)


def source_ids(inputs):
  """The token ids of model inputs: inputs [b, s] themselves, or [b, s, 1 + C] (a token's id and
  its spelling, `TransformerConfig.source_chars`) -> [b, s]."""
  return inputs if inputs.ndim == 2 else inputs[..., 0]
