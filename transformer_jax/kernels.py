"""How the model's math runs on a device, beside the math itself (model/): the fused attention
kernels that stand in for Eq. 1, the matmuls of `matmul_dtype`, and the pre-softmax projection's
backward pass. Each computes what model/ says; tests compare the two (test_fused_attention.py,
test_remat_scan.py, test_refill.py).

`attention_impl` chooses how attention over whole sequences runs: `einsum` (model/attention.py's
`dot_product_attention` itself), `xla` or `cudnn` (`jax.nn.dot_product_attention`'s
implementations: cuDNN's fused kernel on NVIDIA GPUs, bfloat16/float16), or `auto` (cudnn where
it applies, einsum elsewhere). Attention dropout, decode mode and (for `auto`) d_k != d_v run
einsum, as does any call after an edit to Eq. 1 (`eq1_unchanged`).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import inspect
import io
import math
import textwrap
import tokenize
from typing import Any

import jax
import jax.numpy as jnp

ATTENTION_IMPLS = ("auto", "xla", "cudnn", "einsum")


def attention_implementation(
    impl: str,
    *,
    dtype,
    head_dim: int,
    decode: bool,
    dropout: bool,
    dense_mask: bool,
    platform: str | None = None,
    value_dim: int | None = None,
    eq1_unchanged: bool = True,
) -> str:
  """Resolves `attention_impl` for one call to 'einsum', 'xla' or 'cudnn' (module docstring).
  `dense_mask`: a part only a dense array expresses (packed segments, a bias), which `auto` does
  not give cuDNN. `eq1_unchanged`: False after an edit to Eq. 1, which no fused kernel computes
  (model/attention.py `fused_kernels_match`); then only einsum."""
  if impl not in ATTENTION_IMPLS:
    raise ValueError(f"attention_impl={impl!r}; expected one of {ATTENTION_IMPLS}")
  if impl == "einsum" or decode or dropout:
    return "einsum"
  platform = jax.default_backend() if platform is None else platform
  reason = None  # why the fused call `impl` names cannot compute this call
  if not eq1_unchanged:
    reason = (
        "it computes Eq. 1 as dot_product_attention read when the fused kernels were checked "
        "(attention.FUSED_CHECKED_AGAINST), which has changed since; run "
        "tests/test_fused_attention.py and update the digest"
    )
  elif value_dim is not None and value_dim != head_dim:
    reason = f"it needs d_k == d_v; they are {head_dim} and {value_dim}"
  elif impl != "xla":
    reason = cudnn_unsupported_reason(dtype, head_dim, platform)
  if impl == "auto":
    return "einsum" if reason or dense_mask else "cudnn"
  if reason:
    raise ValueError(f"attention_impl={impl!r}: {reason}; use 'auto' or 'einsum'")
  return impl


def cudnn_unsupported_reason(dtype, head_dim: int, platform: str) -> str | None:
  """Why cuDNN's fused attention cannot run this call (None: it can)."""
  if platform not in ("gpu", "cuda"):
    return f"cudnn attention needs an NVIDIA GPU; the default backend is {platform!r}"
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f"cudnn attention takes bfloat16/float16; model.dtype is {jnp.dtype(dtype).name}"
  if head_dim % 8 or head_dim > 128:
    return f"cudnn attention needs head_dim % 8 == 0 and <= 128; head_dim is {head_dim}"
  return None


def fused_attention(cfg, query, key, value, mask, bias, *, dropout, eq1_unchanged, capture=False):
  """Eq. 1 by the fused kernel `cfg.attention_impl` resolves to for this call (an
  attention.MultiHeadAttention's config and operands), or None where the einsum path computes it:
  that resolution, or `capture` (only the einsum path records the attention weights)."""
  dense_mask = bias is not None or (
      mask is not None and (not hasattr(mask, "key_valid") or mask.extra is not None)
  )
  impl = attention_implementation(
      cfg.attention_impl, dtype=cfg.dtype, head_dim=cfg.head_key_dim, value_dim=cfg.head_value_dim,
      decode=cfg.decode, dropout=dropout, dense_mask=dense_mask, eq1_unchanged=eq1_unchanged,
  )  # fmt: skip
  if impl == "einsum" or capture:
    return None
  return fused_dot_product_attention(query, key, value, mask, bias=bias, implementation=impl)


def fused_dot_product_attention(query, key, value, mask, *, bias=None, implementation: str):
  """Eq. 1 through `jax.nn.dot_product_attention` ('xla' or 'cudnn'): [b, q, h, d] -> [b, q, h, d].
  `mask`: an attention.AttentionMask (padding as key lengths, at least 1 so that an all-padding
  filler row stays finite; causality as `is_causal`; its `extra` passed densely) or a dense
  boolean array."""
  dense, causal, key_lengths = mask, False, None
  if hasattr(mask, "key_valid"):  # an AttentionMask
    dense, causal = mask.extra, mask.causal
    if mask.key_valid is not None:
      key_lengths = jnp.maximum(jnp.sum(mask.key_valid, -1, dtype=jnp.int32), 1)  # [b]
  if dense is not None:
    dense = jnp.broadcast_to(dense, (dense.shape[0], 1, query.shape[1], key.shape[1]))
  bias = None if bias is None else bias.astype(query.dtype)
  return jax.nn.dot_product_attention(
      query, key, value, bias=bias, mask=dense, is_causal=causal,
      key_value_seq_lengths=key_lengths, implementation=implementation,
  )  # fmt: skip


@functools.cache
def source_digest(fn: Any) -> str:
  """sha256 of a function's code: its tokens, without its docstring, comments or layout."""
  skip = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
  source = textwrap.dedent(inspect.getsource(fn))
  tokens = [t for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type not in skip]
  docstring = next((t for t in tokens if t.type == tokenize.STRING), None)
  if docstring is not None and ast.literal_eval(docstring.string) == fn.__doc__:
    tokens.remove(docstring)
  return hashlib.sha256("".join(t.string for t in tokens).encode()).hexdigest()


def einsum(cfg, subscripts: str, x: jax.Array, weight: jax.Array) -> jax.Array:
  """einsum of an activation and a layer's weight (both in `cfg.dtype`), or, with
  `cfg.matmul_dtype`, of the two rounded to it, the products summed and returned in `cfg.dtype`
  (`rounded_einsum`: its gradients too)."""
  if cfg.matmul_dtype is None:
    return jnp.einsum(subscripts, x, weight)
  return rounded_einsum(subscripts, cfg.matmul_dtype, cfg.dtype, x, weight)


def dot_general(cfg):
  """A flax Dense's `dot_general` for `cfg.matmul_dtype` (None: flax's own, `cfg.dtype`): its
  input's trailing axes contracted with the kernel's leading ones, as a `rounded_einsum` over
  their flattened forms."""
  if cfg.matmul_dtype is None:
    return None

  def dot(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    del precision, preferred_element_type  # the products are summed in cfg.dtype
    (lhs_axes, rhs_axes), batch_axes = dimension_numbers
    k = len(lhs_axes)
    if batch_axes != ((), ()) or (
        tuple(lhs_axes) != tuple(range(lhs.ndim - k, lhs.ndim))
        or tuple(rhs_axes) != tuple(range(k))
    ):
      raise NotImplementedError(f"matmul_dtype: a Dense contraction, not {dimension_numbers}")
    rows, inner = lhs.shape[: lhs.ndim - k], rhs.shape[:k]
    flat = rounded_einsum(
        "ni,io->no",
        cfg.matmul_dtype,
        cfg.dtype,
        lhs.reshape(-1, math.prod(inner)),
        rhs.reshape(math.prod(inner), -1),
    )
    return flat.reshape(rows + rhs.shape[k:])

  return dot


def rounded_einsum(subscripts: str, dtype: Any, out_dtype: Any, x: jax.Array, w: jax.Array):
  """einsum(subscripts, x, w) of the two rounded to `dtype`, the products summed and returned in
  `out_dtype` (`matmul_dtype`, a deviation: bfloat16 products run at about twice float32's rate
  on a CPU with bf16 dot products, docs/experiments.md). Its backward rounds the output's
  gradient to `dtype` too, so that the two matmuls of the backward pass are of the same kind;
  left to JAX, they would multiply a float32 gradient by a bf16 operand, in float32. Each index
  of x and w appears in one of the other two terms (a layer's matmul), as the backward needs."""
  # In out_dtype on the way in, so that the gradients returned are of the operands' dtype.
  return _rounded_einsum(subscripts, dtype, out_dtype, x.astype(out_dtype), w.astype(out_dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _rounded_einsum(subscripts, dtype, out_dtype, x, w):
  return jnp.einsum(subscripts, x.astype(dtype), w.astype(dtype), preferred_element_type=out_dtype)


def _rounded_einsum_fwd(subscripts, dtype, out_dtype, x, w):
  x, w = x.astype(dtype), w.astype(dtype)
  return jnp.einsum(subscripts, x, w, preferred_element_type=out_dtype), (x, w)


def _rounded_einsum_bwd(subscripts, dtype, out_dtype, residuals, g):
  x, w = residuals  # rounded to dtype
  inputs, out = subscripts.replace(" ", "").split("->")
  x_axes, w_axes = inputs.split(",")
  if not (set(x_axes) <= set(w_axes + out) and set(w_axes) <= set(x_axes + out)):
    raise NotImplementedError(f"rounded_einsum: {subscripts!r} sums an axis of one operand alone")
  g = g.astype(dtype)
  dx = jnp.einsum(f"{out},{w_axes}->{x_axes}", g, w, preferred_element_type=out_dtype)
  dw = jnp.einsum(f"{x_axes},{out}->{w_axes}", x, g, preferred_element_type=out_dtype)
  return dx, dw


_rounded_einsum.defvjp(_rounded_einsum_fwd, _rounded_einsum_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def output_projection(x: jax.Array, embedding: jax.Array, matmul_dtype: Any = None) -> jax.Array:
  """x [b, t, e] @ embedding [v, e]ᵀ -> logits [b, t, v], float32 (§3.4's shared pre-softmax
  layer). The custom backward only fixes which operand XLA transposes for the embedding gradient:
  left alone, XLA:CPU materialises the transpose of the logits gradient [v, b*t] (the largest
  tensor of the step); here it transposes x [e, b*t] and the small result [e, v] instead. With
  `matmul_dtype` (a deviation, model/config.py) x, the embedding and, in the backward pass, the
  logits' gradient are rounded to it, as `rounded_einsum` does."""
  if matmul_dtype is not None:
    x, embedding = x.astype(matmul_dtype), embedding.astype(matmul_dtype)
  return jnp.einsum("bte,ve->btv", x, embedding, preferred_element_type=jnp.float32)


def _output_projection_fwd(x, embedding, matmul_dtype):
  return output_projection(x, embedding, matmul_dtype), (x, embedding)


def _output_projection_bwd(matmul_dtype, residuals, g):
  """The gradients JAX's own rule computes (same dtypes: float32 accumulation, cast back); with
  `matmul_dtype`, of the operands and the gradient g rounded to it."""
  x, embedding = residuals  # g: [b, t, v] float32
  x_in, embedding_in = x, embedding
  f32 = jnp.float32
  if matmul_dtype is not None:
    x, embedding, g = x.astype(matmul_dtype), embedding.astype(matmul_dtype), g.astype(matmul_dtype)
    # As matrices: XLA:CPU runs a bf16 x bf16 -> float32 product of two contracted axes in a
    # kernel that does not take those types.
    b, t, e = x.shape
    x, g = x.reshape(b * t, e), g.reshape(b * t, -1)
    dx = jax.lax.dot_general(g, embedding, (((1,), (0,)), ((), ())), preferred_element_type=f32)
    x_t = jax.lax.optimization_barrier(x.T)  # [e, b*t], materialised
    d_embedding = jax.lax.dot_general(x_t, g, (((1,), (0,)), ((), ())), preferred_element_type=f32)
    return dx.reshape(b, t, e).astype(x_in.dtype), d_embedding.T.astype(embedding_in.dtype)
  dx = jax.lax.dot_general(g, embedding, (((2,), (0,)), ((), ())), preferred_element_type=f32)
  x_t = jax.lax.optimization_barrier(jnp.transpose(x, (2, 0, 1)))  # [e, b, t], materialised
  d_embedding = jax.lax.dot_general(
      x_t, g, (((1, 2), (0, 1)), ((), ())), preferred_element_type=f32
  ).T  # [e, v] -> [v, e]
  return dx.astype(x_in.dtype), d_embedding.astype(embedding_in.dtype)  # [b, t, e], [v, e]


output_projection.defvjp(_output_projection_fwd, _output_projection_bwd)
