"""The model's hyperparameters (`TransformerConfig`): the keys of `config.model`, which builds it
as `TransformerConfig(vocab_size, **config.model)`, and the modes. No Flax here: attention.py and
transformer.py read it, transformer_jax/config.py validates against it."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from transformer_jax.kernels import ATTENTION_IMPLS  # how attention runs: kernels.py

# Token id 0 is padding everywhere (masked out of attention and of the loss); the tokenizers
# (data/tokenizer.py) give it the same id.
PAD_ID = 0
BOS_ID = 2  # the decoder's first input (decoding/decoder.py); the tokenizers' BOS

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


# How a layer is rematerialised: what each keeps, parallel/layer_params.py.
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch")


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Hyperparameters, named as in the paper. Defaults are the base model (Table 3, row 'base').

  Modes are made with `.replace(...)`: `deterministic=True` for evaluation (no dropout) and
  `decode=True` for step-by-step decoding, its keys and values kept by `cache`.
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
  # 0 (the paper): order only through `positional`. K > 0 (a deviation): the encoder's clipped
  # relative positions (transformer.py RelativePositions).
  relative_positions: int = 0
  norm_position: str = "post"  # "post": LayerNorm(x + Sublayer(x)) as in §3.1; "pre": pre-LN
  layer_norm_epsilon: float = 1e-6
  dtype: Any = jnp.float32  # compute dtype; bfloat16 for mixed precision
  # The layers' matmuls (not attention over keys): None, in `dtype`; bfloat16 (a deviation, for
  # speed on CPUs with bf16 dot products): inputs, and in training the gradients of their
  # outputs, rounded to it, products summed in `dtype` (kernels.py `rounded_einsum`).
  matmul_dtype: Any = None
  param_dtype: Any = jnp.float32
  attention_impl: str = "auto"  # one of ATTENTION_IMPLS (kernels.py)
  remat_policy: str = "none"  # one of REMAT_POLICIES
  scan_layers: bool = False  # nn.scan over layers; parameters stacked on a leading axis
  deterministic: bool = False
  decode: bool = False
  # Decode mode: the Flax module class in which each decoder attention layer keeps its keys and
  # values (attention.py `CachedKeys`; the searches' is decoding/kv_cache.py's).
  cache: Any = None

  def __post_init__(self):
    for name in ("dtype", "param_dtype", "matmul_dtype"):  # a name ("bfloat16") or a jnp dtype
      value = getattr(self, name)
      if isinstance(value, str) and value not in DTYPES:
        raise ValueError(f"unknown dtype {value!r}; expected one of {sorted(DTYPES)}")
      object.__setattr__(self, name, DTYPES.get(value, value))  # frozen: through object
    positive = ("vocab_size", "d_model", "num_heads", "num_layers", "d_ff", "max_len")
    checks = [(getattr(self, f) > 0, f"{f}={getattr(self, f)} must be positive") for f in positive]
    dims = (self.key_dim, self.value_dim, self.num_decoder_layers)
    rates = (self.dropout_rate, self.attention_dropout_rate)
    checks += [
        (None not in dims[:2] or self.d_model % self.num_heads == 0,
         f"d_model={self.d_model} must be divisible by num_heads={self.num_heads} "
         "(or set key_dim and value_dim)"),
        (all(d is None or d > 0 for d in dims),
         f"key_dim={dims[0]}, value_dim={dims[1]} and num_decoder_layers={dims[2]} must be "
         "positive or None"),
        (all(0.0 <= r < 1.0 for r in rates),
         f"dropout_rate={rates[0]}, attention_dropout_rate={rates[1]}: not in [0, 1)"),
        (self.relative_positions >= 0,
         f"relative_positions={self.relative_positions} must be >= 0"),
        (self.positional != "sinusoidal" or self.d_model % 2 == 0,
         f"sinusoidal positions need an even d_model, got {self.d_model}"),
    ]  # fmt: skip
    for field, allowed in (
        ("positional", ("sinusoidal", "learned")),
        ("norm_position", ("post", "pre")),
        ("attention_impl", ATTENTION_IMPLS),
        ("remat_policy", REMAT_POLICIES),
    ):
      value = getattr(self, field)
      expected = " or ".join(map(repr, allowed)) if len(allowed) == 2 else f"one of {allowed}"
      checks.append((value in allowed, f"{field}={value!r}; expected {expected}"))
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

  def replace(self, **changes) -> TransformerConfig:
    return dataclasses.replace(self, **changes)
