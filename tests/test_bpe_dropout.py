"""BPE-dropout (data/bpe_dropout.py): Algorithm 1 of Provilkov et al. 2020 against its
probabilities, the tokenizer's own ids at rate 0, and epochs that resume exactly."""

import random

import numpy as np
import pytest

from transformer_jax import config as config_lib
from transformer_jax.data import batching, bpe_dropout, prepared
from transformer_jax.data.tokenizer import UNK_ID, train_sentencepiece

W = bpe_dropout.WORD_START


def _frequencies(symbols, rank, rate, n, seed=0):
  draw = random.Random(seed).random
  counts = {}
  for _ in range(n):
    key = tuple(bpe_dropout.segment(list(symbols), rank, rate, draw))
    counts[key] = counts.get(key, 0) + 1
  return {k: v / n for k, v in counts.items()}


def _close(freq, p, n):
  return abs(freq - p) <= 5 * np.sqrt(p * (1 - p) / n) + 1e-9


def test_one_merge_is_dropped_at_the_rate():
  n, rate = 20_000, 0.3
  freq = _frequencies([W, "a"], {W + "a": 0}, rate, n)
  assert _close(freq.get((W, "a"), 0.0), rate, n)
  assert _close(freq.get((W + "a",), 0.0), 1 - rate, n)


def test_three_characters_follow_algorithm_1():
  # Merges ab (first), bc, abc. Step 1 drops each of ab and bc with p; the best one left is
  # applied; step 2 offers abc, dropped with p. So, with q = 1 - p:
  # abc: q*q (ab kept) + p*q*q (ab dropped, bc kept); ab|c: q*p; a|bc: p*q*p; a|b|c: p*p.
  p, n = 0.3, 40_000
  q = 1 - p
  rank = {"ab": 0, "bc": 1, "abc": 2}
  freq = _frequencies(["a", "b", "c"], rank, p, n)
  expected = {
      ("abc",): q * q + p * q * q,
      ("ab", "c"): q * p,
      ("a", "bc"): p * q * p,
      ("a", "b", "c"): p * p,
  }
  assert abs(sum(expected.values()) - 1) < 1e-12
  assert set(freq) == set(expected)
  for key, prob in expected.items():
    assert _close(freq[key], prob, n), (key, freq[key], prob)


def test_rate_zero_is_plain_bpe_leftmost_first():
  # Without dropout: lowest rank first, a tie to the leftmost place.
  assert bpe_dropout.segment(list("aaa"), {"aa": 0}, 0.0) == ["aa", "a"]
  assert bpe_dropout.segment(list("abcd"), {"bc": 0, "ab": 1, "abcd": 2}, 0.0) == ["a", "bc", "d"]


def _words(rng, count):
  letters = "abcdefghiklmnoprstuvwyzäöü"
  return ["".join(rng.choice(list(letters), size=rng.integers(1, 9))) for _ in range(count)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """A BPE vocabulary trained on generated sentences, and those sentences as examples."""
  rng = np.random.default_rng(0)
  words = _words(rng, 400)
  weights = 1 / np.arange(1, len(words) + 1)  # Zipf-like, so merges form
  weights /= weights.sum()

  def sentence():
    return " ".join(rng.choice(words, size=rng.integers(1, 12), p=weights))

  pairs = [(sentence(), sentence().capitalize() + ".") for _ in range(600)]
  directory = tmp_path_factory.mktemp("bpe")
  tokenizer = train_sentencepiece(
      (s for pair in pairs for s in pair), str(directory / "spm"), vocab_size=300
  )
  source = prepared.TokenArrays.from_sequences([tokenizer.encode(s) for s, _ in pairs])
  target = prepared.TokenArrays.from_sequences([tokenizer.encode(t) for _, t in pairs])
  return tokenizer, pairs, prepared.Examples(source, target), directory


def test_rate_zero_gives_the_tokenizers_ids(corpus):
  tokenizer, _, examples, _ = corpus
  got = bpe_dropout.BpeDropout(tokenizer, examples, 0.0, seed=0).examples(3)
  assert got == examples


def test_a_word_with_unk_is_kept_whole(corpus):
  tokenizer, _, examples, _ = corpus
  # A character the vocabulary lacks is <unk> inside its word: no merges can spell it.
  sources = [list(s) for s, _ in examples]
  sources[0] = [sources[0][0], UNK_ID, *sources[0][1:]]
  with_unk = prepared.Examples(prepared.TokenArrays.from_sequences(sources), examples.target)
  starts_word = [piece.startswith(W) for piece, _, _ in tokenizer.pieces()]
  end = next((i for i in range(1, len(sources[0])) if starts_word[sources[0][i]]), None)
  word = sources[0][:end]  # the first word's pieces, <unk> among them
  dropout = bpe_dropout.BpeDropout(tokenizer, with_unk, 0.5, seed=0)
  for epoch in range(5):
    assert dropout.examples(epoch)[0][0][: len(word)] == word


def test_an_epoch_is_the_same_text_segmented_anew(corpus):
  tokenizer, pairs, examples, _ = corpus
  dropout = bpe_dropout.BpeDropout(tokenizer, examples, 0.1, seed=0)
  epoch0, epoch1 = dropout.examples(0), dropout.examples(1)
  for epoch in (epoch0, epoch1):
    assert len(epoch) == len(pairs)
    for (src, tgt), (src_ids, tgt_ids) in zip(pairs, epoch):
      assert tokenizer.decode(src_ids) == src and tokenizer.decode(tgt_ids) == tgt
  # Dropped merges leave more, shorter pieces; each epoch draws its own.
  assert len(epoch0.source.tokens) > len(examples.source.tokens)
  assert len(epoch0.target.tokens) > len(examples.target.tokens)
  assert epoch0 != epoch1
  # A pure function of (seed, epoch): another instance, or the epoch asked again, agrees.
  again = bpe_dropout.BpeDropout(tokenizer, examples, 0.1, seed=0)
  assert again.examples(1) == epoch1 and again.examples(0) == epoch0
  assert bpe_dropout.BpeDropout(tokenizer, examples, 0.1, seed=1).examples(0) != epoch0


def test_one_side_only(corpus):
  tokenizer, _, examples, _ = corpus
  source_only = bpe_dropout.BpeDropout(tokenizer, examples, 0.1, seed=0, sides="source")
  both = bpe_dropout.BpeDropout(tokenizer, examples, 0.1, seed=0)
  got, want = source_only.examples(2), both.examples(2)
  assert got.target is examples.target
  assert np.array_equal(got.source.tokens, want.source.tokens)
  target_only = bpe_dropout.BpeDropout(tokenizer, examples, 0.1, seed=0, sides="target")
  got = target_only.examples(2)
  assert got.source is examples.source
  assert np.array_equal(got.target.tokens, want.target.tokens)
  with pytest.raises(ValueError, match="sides='neither'"):
    bpe_dropout.BpeDropout(tokenizer, examples, 0.1, seed=0, sides="neither")


def test_a_vocabulary_that_is_not_bpe_is_refused(corpus):
  _, pairs, _, directory = corpus
  unigram = train_sentencepiece(
      (s for pair in pairs for s in pair),
      str(directory / "uni"),
      vocab_size=300,
      model_type="unigram",
  )
  examples = prepared.Examples(
      prepared.TokenArrays.from_sequences([unigram.encode(s) for s, _ in pairs]),
      prepared.TokenArrays.from_sequences([unigram.encode(t) for _, t in pairs]),
  )
  with pytest.raises(ValueError, match="needs a SentencePiece BPE vocabulary"):
    bpe_dropout.BpeDropout(unigram, examples, 0.1, seed=0)


def _batches(iterator, n):
  return [next(iterator) for _ in range(n)]


def test_batches_resume_exactly_across_epochs(corpus):
  tokenizer, _, examples, _ = corpus

  def make():
    dropout = bpe_dropout.BpeDropout(tokenizer, examples, 0.1, seed=0)
    return batching.BatchIterator(
        examples,
        seed=0,
        bucket_lengths=(8, 16, 32, 64),
        tokens_per_batch=256,
        resample=dropout.examples,
    )

  iterator = make()
  per_epoch = iterator.batches_per_epoch
  first = _batches(iterator, per_epoch + 3)  # into epoch 1
  state = iterator.get_state()
  assert state["epoch"] == 1
  rest = _batches(iterator, 2 * per_epoch)  # through epoch 2 into 3
  resumed = make()
  resumed.set_state(state)
  for a, b in zip(rest, _batches(resumed, len(rest))):
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
  # The same pairs, other pieces: epoch 1 does not repeat epoch 0's batches.
  plain = batching.BatchIterator(
      examples, seed=0, bucket_lengths=(8, 16, 32, 64), tokens_per_batch=256
  )
  assert sum(map(np.size, (b["targets"] for b in first))) > 0
  assert any(
      a["targets"].shape != b["targets"].shape or not np.array_equal(a["targets"], b["targets"])
      for a, b in zip(first, _batches(plain, len(first)))
  )


def test_config_refuses_bpe_dropout_without_a_sentencepiece_corpus():
  config = config_lib.default_config()
  config.data.bpe_dropout = 0.1  # the default source is synthetic: a word vocabulary
  with pytest.raises(config_lib.ConfigError, match="data.bpe_dropout"):
    config_lib.validate(config)
  config.data.bpe_dropout = 1.0
  with pytest.raises(config_lib.ConfigError, match="data.bpe_dropout"):
    config_lib.validate(config)
