"""Greedy search in rows that finished sentences leave (decoding/refill.py): the ring cache's
mask, and each sentence's translation equal to the reference greedy search of it alone."""

import functools

import jax
import numpy as np
import pytest
from variants import MODELS

from tests.test_beam_search import CONFIG, EXTRA, VOCAB, tiny_model
from transformer_jax import config as config_lib
from transformer_jax.data.tokenizer import EOS_ID, PAD_ID
from transformer_jax.decoding import batch_shapes, decode, kv_cache, refill, search
from transformer_jax.decoding import decoder as decoder_lib
from transformer_jax.decoding.batch_shapes import Shapes
from transformer_jax.runs import inference

# greedy: the first maximum of the logits; the paper's model and a variant (tests/variants.py)
DECODERS = {
    name: decoder_lib.Decoder(model(CONFIG), normalize=False) for name, model in MODELS.items()
}
BUCKETS = (4, 8, 12)


def _mask(index, starts, length):
  """[rows, n]: the columns each row of a one-slot cache of n positions attends to at step
  `index` (kv_cache.SelfKV.write), a ring with `starts` (None: not a ring)."""
  rows = 3 if starts is None else len(starts)
  zeros = np.zeros((rows, 1, 1, length), np.float32)
  cache = kv_cache.SelfKV(zeros, zeros.transpose(0, 1, 3, 2), np.int32(index))
  if starts is not None:
    cache = cache.restart(np.asarray(starts, np.int32))
  _, keys = cache.write(np.zeros((rows, 1, 1, 1), np.float32), np.zeros((rows, 1, 1, 1)))
  return np.asarray(keys.mask)[:, 0, 0]  # [b, 1, q, n] -> [b, n]


@pytest.mark.parametrize("length", [1, 5])
def test_ring_mask_is_the_columns_each_row_wrote_since_its_start(length):
  """Column c is attended at step t iff the last step <= t that wrote it (t' % n == c) is at
  or after the row's start; with no start, the causal mask of a cache of n positions."""
  for index in range(3 * length):
    starts = np.arange(-1, index + 1)
    mask = _mask(index, starts, length)
    for row, start in enumerate(starts):
      for column in range(length):
        last = max(t for t in range(-length, index + 1) if t % length == column)
        assert mask[row, column] == (last >= start), (index, start, column)
  causal = _mask(2, None, 4)
  assert (causal == (np.arange(4) <= 2)).all()


def test_a_ring_has_one_slot():
  zeros = np.zeros((1, 1, 1, 3), np.float32)
  cache = kv_cache.SelfKV(zeros, zeros.transpose(0, 1, 3, 2), np.int32(0)).widen(2)
  with pytest.raises(ValueError, match="cannot be a ring"):
    cache.restart(np.zeros(1, np.int32))


def sources(count, seed=0):
  """`count` token-id sources (no EOS) of 1 to 11 tokens, in no order of length."""
  rng = np.random.default_rng(seed)
  return [rng.integers(3, VOCAB, rng.integers(1, 12)).tolist() for _ in range(count)]


@functools.partial(jax.jit, static_argnames=("name",))
def _reference(params, inputs, name):
  n = min(inputs.shape[1] + EXTRA, CONFIG.max_len)
  limit = search.output_limits(inputs, EXTRA, n)
  return search.greedy_search(DECODERS[name], params, inputs, n, limit=limit)[0]


def reference(params, source, name="stock"):
  """search.greedy_search of one source alone, padded to its bucket, with its output limit."""
  length = next(b for b in BUCKETS if b >= len(source) + 1)
  inputs = np.full((1, length), PAD_ID, np.int32)
  inputs[0, : len(source) + 1] = source + [EOS_ID]
  return _strip(np.asarray(_reference(params, inputs, name))[0])


def _strip(tokens) -> list[int]:
  tokens = [int(t) for t in tokens if t != PAD_ID]
  return tokens[: tokens.index(EOS_ID) + 1] if EOS_ID in tokens else tokens


@pytest.mark.slow  # ~10 s on 2 cores: .ci/run runs it after the default suite
@pytest.mark.parametrize("name", list(MODELS))
def test_refill_gives_each_sentence_its_greedy_search_alone(name):
  """37 sentences in 4 rows, 2 at a time: rows refill at different steps, the ring of 15
  columns wraps several times, a last chunk of one is padded, and the tail goes on in 2 rows.
  Every translation is the reference's of its sentence alone, ended by EOS or the limit."""
  params, _ = tiny_model(name)
  refiller = refill.RefillGreedy(DECODERS[name], EXTRA, rows=4, chunk=2, shapes=Shapes(min_rows=2))
  batch = sources(37)
  stats = {}
  got = refiller.search(params, batch, BUCKETS, CONFIG.max_len, stats)
  expected = [reference(params, source, name) for source in batch]
  assert [_strip(tokens) for tokens in got] == expected
  ends = {tokens[-1] == EOS_ID for tokens in expected}
  assert ends == {True, False}  # some reach EOS, some their limit
  columns = min(12 + EXTRA, CONFIG.max_len)
  assert stats["steps"] > 2 * columns  # the ring wrapped
  assert stats["batches"] == 19 and stats["rows"] == 4
  assert stats["row_steps"] < 4 * stats["steps"]  # the tail ran in fewer rows
  assert {s[:2] for s in refiller.signatures if s[0] in ("run", "keep")} >= {("run", 2)}
  # Again, in a call of its own: the same programs, the same translations.
  programs = refiller.programs()
  assert [_strip(t) for t in refiller.search(params, batch[:5], BUCKETS, CONFIG.max_len)] == (
      expected[:5]
  )
  assert refiller.programs() >= programs


def test_rows_are_a_multiple_of_the_chunk():
  with pytest.raises(ValueError, match="multiple of chunk"):
    refill.RefillGreedy(DECODERS["stock"], EXTRA, rows=6, chunk=4)


@pytest.mark.slow  # 5-10 s on 2 cores: .ci/run runs it after the default suite
def test_decode_sources_refills_greedy_only_where_measured():
  """The one decoding path refills greedy search on one CPU device without a constraint, with
  the translations of the batches; beam search, a constraint or several devices go in batches."""
  params, _ = tiny_model()
  one = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), ("data", "fsdp", "tensor"))
  eight = jax.sharding.Mesh(np.array(jax.devices()).reshape(8, 1, 1), ("data", "fsdp", "tensor"))
  refilling = decode.Predictor(CONFIG, EXTRA, refill=True)
  batches = decode.Predictor(CONFIG, EXTRA)
  assert refilling.refills(1, one)
  assert not refilling.refills(4, one) and not refilling.refills(1, eight)
  assert not batches.refills(1, one)
  assert not decode.Predictor(CONFIG, EXTRA, refill=True, constraint=_any).refills(1, one)
  batch = sources(20, seed=1)
  outputs = {}
  for name, predictor in (("refill", refilling), ("batches", batches)):
    stats = {}
    with jax.set_mesh(one):
      outputs[name] = inference.decode_sources(
          predictor, params, batch, BUCKETS, one, beam_size=1, alpha=0.6, batch_tokens=32,
          stats=stats,
      )  # fmt: skip
    assert set(stats) == {"batches", "rows", "steps", "row_steps"} and stats["steps"] > 0
  assert [_strip(t) for t in outputs["refill"]] == [_strip(t) for t in outputs["batches"]]
  assert refilling.refiller.programs() > 0 and refilling.programs() > refilling.searches()


def test_the_eval_config_turns_refilling_on_and_off(monkeypatch):
  """`eval.refill` reaches the search of the commands and evaluations: "auto" (the default) on
  the CPUs where refilled rows measured faster (batch_shapes.REFILL_FASTER_ON), "on", "off"; a
  run saved with the old boolean keeps its meaning."""
  config = config_lib.default_config()
  assert config.eval.refill == "auto"
  for vendor, expected in (("AuthenticAMD", True), ("GenuineIntel", False), ("", False)):
    monkeypatch.setattr(batch_shapes, "cpu_vendor", lambda vendor=vendor: vendor)
    assert (inference.eval_predictor(config, CONFIG, None).refiller is not None) == expected
  config.eval.refill = "on"
  assert inference.eval_predictor(config, CONFIG, None).refiller is not None
  config.eval.refill = "off"
  assert inference.eval_predictor(config, CONFIG, None).refiller is None
  config.eval.refill = "sometimes"
  with pytest.raises(config_lib.ConfigError, match="eval.refill"):
    config_lib.validate(config)
  for saved, meaning in ((True, "auto"), (False, "off")):
    assert config_lib.from_saved({"eval": {"refill": saved}}).eval.refill == meaning


def _any(log_probs, prefixes, limit, inputs):
  return log_probs


def test_the_eval_config_sets_the_searchs_matmul_dtype():
  """`eval.matmul_dtype` (a deviation for speed, off by default) reaches the search's model; a
  dtype it cannot be is refused, naming the key."""
  config = config_lib.default_config()
  assert config.eval.matmul_dtype == ""
  assert inference.eval_predictor(config, CONFIG, None).config.matmul_dtype is None
  config.eval.matmul_dtype = "bfloat16"
  assert inference.eval_predictor(config, CONFIG, None).config.matmul_dtype == jax.numpy.bfloat16
  config.eval.matmul_dtype = "float16"
  with pytest.raises(config_lib.ConfigError, match=r"eval\.matmul_dtype='float16'"):
    config_lib.validate(config)


def test_a_model_trained_with_bfloat16_matmuls_decodes_with_them_unless_told():
  """`model.matmul_dtype` (a training deviation for speed) reaches the model trained and, with
  eval.matmul_dtype "", the search's; eval.matmul_dtype "float32" decodes in float32. A dtype
  the model cannot take is refused before training, naming config.model."""
  config = config_lib.default_config()
  assert config.model.matmul_dtype is None
  config.model.matmul_dtype = "bfloat16"
  model_config = config_lib.model_config(config, 100)
  assert model_config.matmul_dtype == jax.numpy.bfloat16
  assert (
      inference.eval_predictor(config, model_config, None).config.matmul_dtype == jax.numpy.bfloat16
  )
  config.eval.matmul_dtype = "float32"
  assert (
      inference.eval_predictor(config, model_config, None).config.matmul_dtype == jax.numpy.float32
  )
  config.model.matmul_dtype = "bfloat8"
  with pytest.raises(config_lib.ConfigError, match=r"config\.model: .*bfloat8"):
    config_lib.validate(config)
