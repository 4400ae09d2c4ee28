"""The model's hyperparameters (`TransformerConfig`) and the names they take.

This module imports no Flax: attention.py and model.py both read it, config.py validates against
it, and none of them needs the others to know what a model is. Its fields are the keys of
`config.model` (transformer_jax/config.py), which builds it as
`TransformerConfig(vocab_size, **config.model)`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

# Token id 0 is padding everywhere (masked out of attention and of the loss); the tokenizers
# (data/tokenizer.py) give it the same id.
PAD_ID = 0
BOS_ID = 2  # the decoder's first input (incremental.py); the tokenizers' BOS

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
  positional: str = "sinusoidal"  # §3.5; "learned" is Table 3 row (E)
  # 0 (the paper): order reaches the model only through `positional`. K > 0 (a deviation, off by
  # default): the encoder's self-attention also adds to each head's logits a learned scalar for the
  # key's offset from the query, clipped to [-K, K] (Shaw et al. 2018's clipping; one table for all
  # layers, as in Raffel et al. 2020's T5).
  relative_positions: int = 0
  norm_position: str = "post"  # "post": LayerNorm(x + Sublayer(x)) as in §3.1; "pre": pre-LN
  layer_norm_epsilon: float = 1e-6
  dtype: Any = jnp.float32  # compute dtype; bfloat16 for mixed precision
  # The layers' matmuls (projections, FFN, output projection; not attention over keys): None,
  # in `dtype`. bfloat16 (a deviation for decoding, off by default: `eval.matmul_dtype`): their
  # inputs rounded to bfloat16, products summed and returned in `dtype`, which CPUs with bf16
  # dot products (AVX512_BF16, AMX) run ~2x as fast as float32 (docs/experiments.md).
  matmul_dtype: Any = None
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
    if self.matmul_dtype is not None:
      object.__setattr__(self, "matmul_dtype", as_dtype(self.matmul_dtype))
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
            self.positional in ("sinusoidal", "learned"),
            f"positional={self.positional!r}; expected 'sinusoidal' or 'learned'",
        ),
        (
            self.relative_positions >= 0,
            f"relative_positions={self.relative_positions} must be >= 0 (0: none)",
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

  def dummy_inputs(self, rows: int = 1, length: int = 8):
    """PAD inputs [rows, length]: what `init` traces."""
    return jnp.zeros((rows, length), jnp.int32)

  def replace(self, **changes) -> TransformerConfig:
    return dataclasses.replace(self, **changes)


def einsum(cfg: TransformerConfig, subscripts: str, x: jax.Array, weight: jax.Array) -> jax.Array:
  """einsum of an activation and a layer's weight (both in `cfg.dtype`), or, with
  `cfg.matmul_dtype`, of the two rounded to it, the products summed and returned in `cfg.dtype`."""
  if cfg.matmul_dtype is None:
    return jnp.einsum(subscripts, x, weight)
  x, weight = x.astype(cfg.matmul_dtype), weight.astype(cfg.matmul_dtype)
  return jnp.einsum(subscripts, x, weight, preferred_element_type=cfg.dtype)


def dot_general(cfg: TransformerConfig):
  """A flax Dense's `dot_general` for `cfg.matmul_dtype` (None: flax's own, `cfg.dtype`)."""
  if cfg.matmul_dtype is None:
    return None

  def dot(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    del preferred_element_type  # the products are summed in cfg.dtype
    lhs, rhs = lhs.astype(cfg.matmul_dtype), rhs.astype(cfg.matmul_dtype)
    return jax.lax.dot_general(
        lhs, rhs, dimension_numbers, precision, preferred_element_type=cfg.dtype
    )

  return dot
