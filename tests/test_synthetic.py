"""The synthetic task: deterministic, disjoint splits, and really reordered."""

import pytest

from transformer_jax.data.synthetic import SyntheticTask
from transformer_jax.data.tokenizer import UNK_ID

SMALL = dict(num_train=2000, num_valid=200, num_test=200)


@pytest.fixture(scope="module")
def task():
  return SyntheticTask(seed=3, **SMALL)


def test_deterministic_for_a_seed(task):
  again = SyntheticTask(seed=3, **SMALL)
  for split in ("train", "valid", "test"):
    assert task.pairs(split) == again.pairs(split)
  assert task.vocabulary() == again.vocabulary()


def test_different_seeds_differ(task):
  other = SyntheticTask(seed=4, **SMALL)
  assert task.vocabulary() != other.vocabulary()
  assert task.pairs("test") != other.pairs("test")


def test_split_sizes_and_disjoint_sources(task):
  sources = {split: [s for s, _ in task.pairs(split)] for split in ("train", "valid", "test")}
  assert [len(sources[s]) for s in ("train", "valid", "test")] == [2000, 200, 200]
  all_sources = sum(sources.values(), [])
  assert len(set(all_sources)) == len(all_sources)


def test_test_split_does_not_depend_on_num_train(task):
  bigger = SyntheticTask(seed=3, num_train=5000, num_valid=200, num_test=200)
  assert bigger.pairs("test") == task.pairs("test")
  assert bigger.pairs("train")[:2000] == task.pairs("train")


def test_unknown_split_is_an_error(task):
  with pytest.raises(ValueError, match="split='dev'"):
    task.pairs("dev")


def test_lengths(task):
  pairs = task.pairs("train")
  src_lens = [len(s.split()) for s, _ in pairs]
  tgt_lens = [len(t.split()) for _, t in pairs]
  assert min(src_lens) == 5 and max(src_lens) == 14
  assert 5 <= min(tgt_lens) and max(tgt_lens) <= 18
  assert any(len(s.split()) != len(t.split()) for s, t in pairs)  # Two-word translations.


def test_every_word_is_in_the_joint_vocabulary(task):
  tok = task.tokenizer()
  assert len(set(task.vocabulary())) == len(task.vocabulary())
  for split in ("train", "test"):
    for src, tgt in task.pairs(split):
      assert UNK_ID not in tok.encode(src) + tok.encode(tgt)
      assert tok.decode(tok.encode(tgt)) == tgt
  lex = task.lexicon
  assert set(lex.source_words()).isdisjoint(lex.target_words())


def test_verb_moves_to_the_end(task):
  lex = task.lexicon
  verb_translation = dict(zip(lex.verbs, lex.target_verbs))
  for src, tgt in task.pairs("test"):
    words = src.split()
    verb = next(w for w in words if w in verb_translation)
    assert 2 <= words.index(verb) <= 4  # After the subject NP in the source ...
    assert tuple(tgt.split()[-len(verb_translation[verb]) :]) == verb_translation[verb]  # ... last.


def test_adjectives_follow_the_noun_in_the_target(task):
  lex = task.lexicon
  source_adjectives = set(lex.adjectives)
  target_adjectives = {w for entry in lex.target_adjectives for w in entry}
  target_determiners = {w for forms in lex.target_determiners for w in forms}
  source_nouns = set(lex.nouns)
  reordered = 0
  for src, tgt in task.pairs("test"):
    src_words, tgt_words = src.split(), tgt.split()
    for prev, word in zip(src_words, src_words[1:]):
      if prev in source_adjectives:
        assert word in source_adjectives or word in source_nouns  # ADJ* NOUN
    for prev, word in zip(tgt_words, tgt_words[1:]):
      if word in target_adjectives:
        assert prev not in target_determiners  # Never DET' ADJ': the noun comes first.
        reordered += 1
  assert reordered > 100


def test_determiner_agrees_with_the_noun_gender(task):
  lex = task.lexicon
  noun_of = {entry[0]: i for i, entry in enumerate(lex.target_nouns)}
  form_of = {
      w: (d, g) for d, forms in enumerate(lex.target_determiners) for g, w in enumerate(forms)
  }
  genders_seen = set()
  for _, tgt in task.pairs("test"):
    words = tgt.split()
    for det, noun in zip(words, words[1:]):
      if det in form_of:
        gender = lex.noun_genders[noun_of[noun]]
        assert form_of[det][1] == gender
        genders_seen.add(gender)
  assert genders_seen == {0, 1, 2}


def test_a_large_training_split_is_generated_whole():
  pairs = SyntheticTask(seed=7, num_train=50_000).pairs("train")
  assert len(pairs) == 50_000 and all(s and t for s, t in pairs)
