"""The model a researcher changes is the model every path runs (docs/changing_the_model.md).

A variant of attention made outside model/ (tests/variants.py: ALiBi slopes in decoder
self-attention) is trained, decoded and loaded as written; Eq. 1 is one function whose change
reaches training and every cached decoding step; the fused kernels stand in for it only while it
is the function they were checked against; a cache written here (full keys and values, gathered
by parent) decodes the same tokens as the searches' own; a model the searches cannot decode is
refused in one line. The other decoding invariants run over {stock, variant} where they are
(test_decode.py, test_beam_search.py, test_refill.py, test_saved_programs.py,
test_remat_scan.py)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_beam_search import CONFIG, EXTRA, tiny_model
from test_third_task import ReversalTask
from test_third_task import _config as reversal_config
from variants import MODELS, SLOW_VARIANTS, AlibiAttention, NaiveCache, alibi_transformer

from transformer_jax import kernels
from transformer_jax.decoding import decode, search
from transformer_jax.decoding import decoder as decoder_lib
from transformer_jax.model import attention
from transformer_jax.model.transformer import Transformer


def _first_steps(model, params, inputs, decoder_inputs):
  """log-probs [b, t, v] of the full forward pass and of cached decoding, step by step."""
  full = jax.nn.log_softmax(model.apply({"params": params}, inputs, decoder_inputs), axis=-1)
  decoder = decoder_lib.Decoder(model)
  encoded = decoder.encode(params, inputs)
  cache = decoder.init_cache(inputs, decoder_inputs.shape[1])
  steps = []
  for t in range(decoder_inputs.shape[1]):
    log_probs, cache = decoder.step(
        params, cache, encoded if t == 0 else None, inputs, decoder_inputs[:, t], t
    )
    steps.append(log_probs)
  return full, jnp.stack(steps, axis=1)


def _pair(seed=0):
  rng = np.random.default_rng(seed)
  inputs = jnp.asarray(rng.integers(3, CONFIG.vocab_size, (3, 5)), jnp.int32)
  decoder_inputs = jnp.asarray(rng.integers(3, CONFIG.vocab_size, (3, 6)), jnp.int32)
  return inputs, decoder_inputs.at[:, 0].set(2)  # BOS first


@pytest.mark.slow  # ~9 s on 2 cores: .ci/run runs it after the default suite
def test_the_variant_differs_from_the_stock_model_on_the_same_parameters():
  params, _ = tiny_model("alibi")
  inputs, decoder_inputs = _pair()
  variant = alibi_transformer(CONFIG).apply({"params": params}, inputs, decoder_inputs)
  stock_params = dict(params)  # the stock model has no slopes: the same parameters otherwise
  stock_params["decoder"] = jax.tree.map(lambda x: x, dict(params["decoder"]))
  layer = dict(stock_params["decoder"]["layer_0"])
  layer["self_attention"] = {
      k: v for k, v in layer["self_attention"].items() if k != "alibi_slopes"
  }
  stock_params["decoder"] = {**stock_params["decoder"], "layer_0": layer}
  stock = Transformer(CONFIG).apply({"params": stock_params}, inputs, decoder_inputs)
  assert float(jnp.abs(variant - stock).max()) > 1e-2
  # Its slopes are its own parameters, started away from neutral (0).
  assert float(jnp.min(params["decoder"]["layer_0"]["self_attention"]["alibi_slopes"])) > 0
  greedy = {
      name: np.asarray(decode.Predictor(MODELS[name](CONFIG), EXTRA)(p, tiny_model(name)[1]))
      for name, p in (("alibi", params), ("stock", stock_params))
  }
  assert (greedy["alibi"] != greedy["stock"]).any()


def _changed_eq1(query, key, value, mask, *, bias=None, **kwargs):
  """Eq. 1 at a temperature of 2: what a researcher's edit to it might be."""
  bias = None if bias is None else bias / 2
  return ORIGINAL_EQ1(query / 2, key, value, mask, bias=bias, **kwargs)


ORIGINAL_EQ1 = attention.dot_product_attention


@pytest.mark.parametrize("name", list(MODELS))
def test_a_change_to_eq1_reaches_training_and_every_cached_step(monkeypatch, name):
  model = MODELS[name](CONFIG)
  params, _ = tiny_model(name)
  inputs, decoder_inputs = _pair(1)
  before, _ = _first_steps(model, params, inputs, decoder_inputs)
  monkeypatch.setattr(attention, "dot_product_attention", _changed_eq1)
  full, cached = _first_steps(model, params, inputs, decoder_inputs)
  assert float(jnp.abs(full - before).max()) > 1e-3  # the change reached the forward pass
  np.testing.assert_allclose(cached, full, rtol=1e-6, atol=1e-5)  # every decoding step alike
  # No fused kernel computes the changed function: `auto` keeps to it, an explicit one refuses.
  assert not attention.fused_kernels_match()
  args = dict(dtype=jnp.bfloat16, head_dim=64, decode=False, dropout=False, dense_mask=False)
  args.update(platform="gpu", eq1_unchanged=attention.fused_kernels_match())
  assert kernels.attention_implementation("auto", **args) == "einsum"
  with pytest.raises(ValueError, match="FUSED_CHECKED_AGAINST"):
    kernels.attention_implementation("cudnn", **args)


def test_the_fused_kernels_were_checked_against_eq1_as_it_reads():
  """FUSED_CHECKED_AGAINST is the digest of `dot_product_attention` as tests/
  test_fused_attention.py checked the fused kernels against it. After an edit to the function,
  this fails: run those tests, and if they pass, set the digest to the one printed here."""
  digest = kernels.source_digest(attention.dot_product_attention)
  assert digest == attention.FUSED_CHECKED_AGAINST, digest
  assert attention.fused_kernels_match()
  args = dict(dtype=jnp.bfloat16, head_dim=64, decode=False, dropout=False, dense_mask=False)
  assert kernels.attention_implementation("auto", **args, platform="gpu") == "cudnn"


# The variant and beam 4 (~8 s each) in .ci/run's slow stage, after the default suite.
@pytest.mark.parametrize("name", SLOW_VARIANTS)
@pytest.mark.parametrize("beam_size", [1, pytest.param(4, marks=pytest.mark.slow)])
def test_a_naive_cache_decodes_the_same_tokens_as_the_searches_own(name, beam_size):
  """The same model, decoded with NaiveCache (full keys and values per row, gathered by parent;
  no slot table, no ring), gives the greedy and beam-4 tokens of kv_cache.SlotCache: what the
  search needs of a cache goes through the cache's own interface."""
  model = MODELS[name](CONFIG)
  params, inputs = tiny_model(name)
  fast = decode.Predictor(model, EXTRA, beam_size, 0.6, refill=True)
  naive = decode.Predictor(model, EXTRA, beam_size, 0.6, refill=True, cache=NaiveCache)
  assert fast.refiller is not None and naive.refiller is None  # no ring: batches
  np.testing.assert_array_equal(naive(params, inputs), fast(params, inputs))
  if beam_size > 1:  # and the k-best reference search, every hypothesis and score
    n = inputs.shape[1] + EXTRA
    got, want = (
        jax.jit(lambda p, x, d=d: search.beam_search(d, p, x, n, beam_size, 0.6)[:2])(
            params, inputs
        )
        for d in (decoder_lib.Decoder(model, NaiveCache), decoder_lib.Decoder(model))
    )
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_allclose(got[1], want[1], rtol=1e-6)


class EncoderOnly(nn.Module):
  config: object

  @nn.compact
  def __call__(self, inputs, decoder_inputs=None):
    return nn.Dense(4)(nn.Embed(self.config.vocab_size, 8)(inputs))


def test_a_model_the_searches_cannot_decode_is_refused_in_one_line():
  with pytest.raises(decoder_lib.NotDecodable, match=r"EncoderOnly .* no `encode`, no `decode`"):
    decoder_lib.check_decodable(EncoderOnly(CONFIG))
  with pytest.raises(decoder_lib.NotDecodable, match="EncoderOnly"):
    from transformer_jax import config as config_lib
    from transformer_jax.runs import inference

    inference.eval_predictor(config_lib.default_config(), EncoderOnly(CONFIG), None)
  decoder_lib.check_decodable(alibi_transformer(CONFIG))  # the variant can be


def test_plot_attention_draws_the_variant():
  from transformer_jax import plot_attention

  params, _ = tiny_model("alibi")
  maps = plot_attention.attention_weights(alibi_transformer(CONFIG), params, [3, 4, 1], [5, 1])
  weights = maps["decoder/layer_0/self_attention"]  # [h, t, t]: BOS + the output
  assert weights.shape == (CONFIG.num_heads, 2, 2)
  np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-5)
  assert np.allclose(np.triu(weights, 1), 0.0)  # causal, as ever


def test_export_refuses_a_variant():
  from transformer_jax.serving import ctranslate2_model

  reason = ctranslate2_model.unsupported_reason(alibi_transformer(CONFIG))
  assert reason and "AlibiAttention" in reason
  assert ctranslate2_model.unsupported_reason(Transformer(CONFIG)) is None
  assert issubclass(AlibiAttention, attention.MultiHeadAttention)


# ----------------------------------------------------------------------------- a run of the variant


class AlibiReversal(ReversalTask):
  """test_third_task.py's reversal task (its name and config section) with the variant as its
  model."""

  def build_model(self, config, tokenizer):
    from transformer_jax import config as config_lib

    return alibi_transformer(config_lib.model_config(config, tokenizer.vocab_size))


@pytest.mark.slow  # ~40 s on 2 cores: .ci/run runs it after the default suite
def test_the_variant_trains_and_is_what_load_run_decodes(tmp_path):
  from transformer_jax import tasks
  from transformer_jax.runs import inference
  from transformer_jax.training import train

  tasks.register(AlibiReversal())
  try:
    config = reversal_config(num_steps=300)
    config.eval.beam_size = 4
    results = train.run(config, str(tmp_path), devices=jax.devices()[:1])
    assert results["test_exact_match"] >= 0.9, results  # the variant learned to reverse
    run = inference.load_run(str(tmp_path), devices=jax.devices()[:1])
    assert run.model.attention is AlibiAttention and run.predictor.model == run.model
    slopes = run.params["decoder"]["layer_0"]["self_attention"]["alibi_slopes"]
    assert float(jnp.min(slopes)) > 0  # trained, and still away from neutral
    lines = ["a b c", "d e f g", "h a"]
    expected = [" ".join(reversed(line.split())) for line in lines]
    assert run.decode_lines(lines) == expected
    assert run.decode_lines(lines, beam_size=1) == expected
  finally:
    tasks.unregister("reversal")


@pytest.mark.slow  # ~15 s on 2 cores: .ci/run runs it after the default suite
def test_a_run_is_never_decoded_by_another_model_than_it_trained(tmp_path):
  """The variant's run, loaded where its task is not registered (the reversal task builds the
  paper's model), is refused in one line naming both models, not decoded by the wrong one."""
  from transformer_jax import tasks
  from transformer_jax.errors import UserError
  from transformer_jax.runs import inference
  from transformer_jax.training import train

  tasks.register(AlibiReversal())
  try:
    train.run(reversal_config(num_steps=20), str(tmp_path), devices=jax.devices()[:1])
  finally:
    tasks.unregister("reversal")
  tasks.register(ReversalTask())
  try:
    with pytest.raises(UserError, match="AlibiAttention.*MultiHeadAttention.*register the task"):
      inference.load_run(str(tmp_path), devices=jax.devices()[:1])
  finally:
    tasks.unregister("reversal")
