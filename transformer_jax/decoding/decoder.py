"""A run's model as the searches step it, whatever its class: `encode` once, then `decode` one
token per step in decode mode against a cache of nodes that `widen`, `follow` and `grow`
(docs/changing_the_model.md); a scanned stack is decoded unrolled. b sentences, s source length,
n output length, v vocabulary, k beams, r = b * k rows."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import traverse_util

from transformer_jax.decoding import kv_cache
from transformer_jax.errors import UserError
from transformer_jax.model.config import BOS_ID, PAD_ID
from transformer_jax.parallel.layer_params import unstack_layer_params


class NotDecodable(UserError):
  """A model the searches cannot decode, named with what it lacks."""


def check_decodable(model: Any, cache: Any = kv_cache.SlotCache) -> None:
  """Raises NotDecodable, in one line naming what is missing, unless the searches can decode
  `model`: its methods, a config with the decode mode, and a cache kept in decode mode."""
  config = getattr(model, "config", None)
  what = f"{type(model).__name__} cannot be decoded by the searches"
  missing = [f"`{m}`" for m in ("encode", "decode") if not callable(getattr(model, m, None))]
  if not missing and not all(hasattr(config, f) for f in ("replace", "decode", "cache")):
    missing = ["`config` with the decode mode (TransformerConfig's `decode` and `cache`)"]
  if not missing:
    try:
      shapes = Decoder(model, cache).cache_shapes(jnp.zeros((1, 2), jnp.int32), 2)
    except Exception as e:  # noqa: BLE001 - whatever a model raises in decode mode: named
      first = (str(e).strip().splitlines() or [""])[0]
      raise NotDecodable(f"{what}: its decode mode fails ({type(e).__name__}: {first})") from e
    if not nodes(shapes):
      missing = ["decoding cache (its decode mode keeps no cache nodes)"]
  if missing:
    raise NotDecodable(
        f"{what}: it has no {', no '.join(missing)} (docs/changing_the_model.md), and its task "
        "supplies no predictor of its own"
    )


@dataclasses.dataclass(frozen=True)
class Decoder:
  """`model` run one token a step against its cache. Pure functions; jit the caller."""

  model: Any  # the run's Flax module (Task.build_model's)
  cache: Any = kv_cache.SlotCache  # the module class its attention layers keep keys in
  # False: the steps give the logits, not their log-softmax, for a search that takes the first
  # maximum or renormalizes whatever it is given (decode.Predictor): a pass over [r, v] less.
  normalize: bool = True

  @property
  def stepped(self) -> Any:
    """The model in decode mode."""
    config = self.model.config.replace(
        decode=True, deterministic=True, cache=self.cache, scan_layers=False
    )
    return self.model.clone(config=config)

  def unrolled(self, params) -> Any:
    """`params` as `stepped` takes them (a scanned stack's unstacked)."""
    return unstack_layer_params(params) if self.model.config.scan_layers else params

  def encode(self, params, inputs: jax.Array) -> Any:
    """inputs [b, s] -> encoded [b, s, e]."""
    return self.stepped.apply({"params": self.unrolled(params)}, inputs, method="encode")

  def cache_shapes(self, inputs: jax.Array, length: int) -> Any:
    """The cache's shapes for a batch, one beam, `length` positions (tracing `init`)."""
    decoder_inputs = jnp.zeros((inputs.shape[0], length), jnp.int32)
    init = lambda: self.stepped.init(jax.random.PRNGKey(0), inputs, decoder_inputs)  # noqa: E731
    return jax.eval_shape(init)["cache"]

  def init_cache(self, inputs: jax.Array, length: int) -> Any:
    """A zeroed cache for a batch, one beam, `length` positions."""
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), self.cache_shapes(inputs, length))

  def step(self, params, cache, encoded, inputs, tokens, position):
    """tokens [r] (the previous outputs) at `position` (a scalar, or [r]) -> (log_probs [r, v]
    (logits if not `normalize`), cache). `encoded` [b, s, e] on the first step (it fills the
    cross-attention cache), None after; `inputs` [b, s] for the source's padding."""
    positions = jnp.reshape(jnp.asarray(position, jnp.int32), (-1, 1))  # [1 or r, 1]
    positions = jnp.broadcast_to(positions, (tokens.shape[0], 1))  # [r, 1]
    logits, variables = self.stepped.apply(
        {"params": params, "cache": cache}, encoded, inputs, tokens[:, None], positions,
        method="decode", mutable=["cache"],
    )  # fmt: skip
    logits = logits[:, 0]  # [r, v]
    return (jax.nn.log_softmax(logits, axis=-1) if self.normalize else logits), variables["cache"]

  def start(self, params, inputs: jax.Array, cache_length: int):
    """Encodes and runs the first step (reading BOS) once per sentence. Returns (log_probs
    [b, v], the cache a search carries (one beam, `cache_length` positions), the invariant
    cache (cross-attention's; pass it to `step_fn`))."""
    params, bos = self.unrolled(params), jnp.full((inputs.shape[0],), BOS_ID, jnp.int32)
    cache, encoded = self.init_cache(inputs, cache_length), self.encode(params, inputs)
    log_probs, cache = self.step(params, cache, encoded, inputs, bos, 0)  # [b, v]
    return _no_pad_or_bos(log_probs), *split(cache)

  def step_fn(self, params, inputs: jax.Array, invariant) -> Callable:
    """step_fn(tokens [r], cache, position) -> (log_probs [r, v], cache) over the carried
    cache; it holds the invariant cache, never carried."""
    params = self.unrolled(params)

    def step_fn(tokens, carried, position):
      cache = merge(carried, invariant)
      log_probs, cache = self.step(params, cache, None, inputs, tokens, position)
      return _no_pad_or_bos(log_probs), split(cache)[0]

    return step_fn

  # What a search does to the cache: each node does it to itself (kv_cache.py).
  widen = staticmethod(lambda cache, beams: map_nodes(lambda n: n.widen(beams), cache))
  follow = staticmethod(lambda cache, parents: map_nodes(lambda n: n.follow(parents), cache))
  grow = staticmethod(lambda cache, length: map_nodes(lambda n: n.grow(length), cache))


def nodes(cache) -> dict:
  """{path: node} of a cache collection (its variables' values)."""
  return traverse_util.flatten_dict(cache) if cache else {}


def map_nodes(fn: Callable, cache) -> Any:
  return traverse_util.unflatten_dict({k: fn(v) for k, v in nodes(cache).items()})


def split(cache) -> tuple[Any, Any]:
  """cache -> (the nodes a search carries through its loop, the invariant ones)."""
  flat = nodes(cache)
  carried = {k: v for k, v in flat.items() if not v.invariant}
  invariant = {k: v for k, v in flat.items() if v.invariant}
  return traverse_util.unflatten_dict(carried), traverse_util.unflatten_dict(invariant)


def merge(carried, invariant) -> Any:
  """The inverse of `split`."""
  return traverse_util.unflatten_dict({**nodes(carried), **nodes(invariant)})


def _no_pad_or_bos(log_probs: jax.Array) -> jax.Array:
  """An emitted PAD would read as padding, and BOS only starts a sentence: never outputs."""
  return log_probs.at[:, (PAD_ID, BOS_ID)].set(-jnp.inf)
