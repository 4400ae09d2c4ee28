"""From `config.data` to a tokenizer and tokenized splits: the one place sources are chosen.

`load_dataset(config, workdir)` returns a `Dataset` holding the tokenizer and, per split, the raw
sentence pairs (for BLEU references) and their token ids (for batching). The trainer, the
evaluation code and the benchmarks all go through here.

Sources (`config.data.source`):
  synthetic  the generated task of data/synthetic.py, with its fixed word vocabulary
  text       a directory of line-aligned `{split}.{lang}` files (data/text.py)
  tfds       a TFDS translation dataset such as 'wmt14_translate/de-en' (data/tfds_source.py)

The vocabulary belongs to the workdir: the first run stores it there (`vocab.txt` for the word
vocabulary, `vocab.model` for SentencePiece) and every later load -- a resumed run, translation,
evaluation -- reuses that file, so token ids never change under a checkpoint. For real corpora
one joint SentencePiece model (§3.4, §5.1: source and target share one vocabulary) is trained on
a random sample of at most `config.data.spm_max_sentences` training sentences of both sides.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
import time

import ml_collections
import numpy as np

from transformer_jax.data import batching, synthetic, text, tfds_source
from transformer_jax.data.tokenizer import (
    SentencePieceTokenizer,
    Tokenizer,
    WordTokenizer,
    train_sentencepiece,
)

Pair = tuple[str, str]

WORD_VOCAB = "vocab.txt"  # WordTokenizer.save: one token per line
SPM_VOCAB = "vocab.model"  # a SentencePiece model proto
SPM_MODEL_TYPE = "bpe"  # the paper's byte-pair encoding (§5.1)
# Fixed, not config.seed: runs that differ only in seed should share a vocabulary.
_SPM_SAMPLE_SEED = 0


@dataclasses.dataclass
class Split:
  pairs: list[Pair]  # raw (source, target) sentences
  examples: list[batching.Example]  # token ids, no EOS/BOS


@dataclasses.dataclass
class Dataset:
  tokenizer: Tokenizer
  splits: dict[str, Split]  # keys: "train", "eval", "test"
  # One-time costs of load_dataset: {"read_and_vocabulary": s, "tokenize": s}.
  seconds: dict[str, float] = dataclasses.field(default_factory=dict)

  def bucket_lengths(self, data_config: ml_collections.ConfigDict) -> tuple[int, ...]:
    return batching.make_bucket_lengths(
        data_config.max_len,
        num_buckets=data_config.get("num_buckets", 8),  # configs saved before the key existed
        multiple=data_config.bucket_step,
    )

  def eval_bucket_lengths(self, data_config: ml_collections.ConfigDict) -> tuple[int, ...]:
    return eval_bucket_lengths(data_config)


def eval_bucket_lengths(data_config: ml_collections.ConfigDict) -> tuple[int, ...]:
  """At most 8 lengths, multiples of 8: evaluation and translation compile a program per shape
  (beam search costs seconds each), while padding there only costs a little decoding time."""
  return batching.make_bucket_lengths(
      data_config.max_len,
      num_buckets=min(data_config.get("num_buckets", 8), 8),
      multiple=max(data_config.bucket_step, 8),
  )


def load_dataset(config: ml_collections.ConfigDict, workdir: str | None = None) -> Dataset:
  """Reads the configured source, gets the workdir's vocabulary (or makes it) and tokenizes.

  `workdir=None` (benchmarks, notebooks) keeps nothing: a SentencePiece model is trained in a
  temporary directory and only lives in memory.
  """
  d = config.data
  start = time.perf_counter()
  if workdir is not None:
    os.makedirs(workdir, exist_ok=True)
  if d.source == "synthetic":
    task = synthetic.SyntheticTask(
        seed=d.synthetic_seed,
        num_train=d.synthetic_train_size,
        num_valid=d.synthetic_eval_size,
        num_test=d.synthetic_eval_size,
    )
    pairs = {"train": task.pairs("train"), "eval": task.pairs("valid"), "test": task.pairs("test")}
    tokenizer = word_tokenizer(task.tokenizer(), workdir)
  elif d.source in ("text", "tfds"):
    pairs = read_pairs(config)
    if not pairs["train"]:
      raise ValueError(f"config.data: the {d.source} source gave no training pairs")
    tokenizer = sentencepiece_tokenizer(
        pairs["train"], workdir, vocab_size=d.vocab_size, max_sentences=d.spm_max_sentences
    )
  else:
    raise ValueError(
        f"config.data.source={d.source!r}: expected 'synthetic', 'text' or 'tfds'"
    )
  read_seconds = time.perf_counter() - start
  splits = {name: Split(p, _tokenize(tokenizer, p)) for name, p in pairs.items()}
  seconds = {
      "read_and_vocabulary": read_seconds,
      "tokenize": time.perf_counter() - start - read_seconds,
  }
  for name, split in splits.items():
    logging.info("data: %s split has %d pairs", name, len(split.pairs))
  if not splits["train"].pairs:
    raise ValueError(f"config.data: the {d.source} source gave no training pairs")
  logging.info(
      "data: read + vocabulary %.1fs, tokenize %.1fs (vocabulary of %d)",
      seconds["read_and_vocabulary"],
      seconds["tokenize"],
      tokenizer.vocab_size,
  )
  return Dataset(tokenizer=tokenizer, splits=splits, seconds=seconds)


def read_pairs(config: ml_collections.ConfigDict) -> dict[str, list[Pair]]:
  """Raw (source, target) pairs of the 'train', 'eval' and 'test' splits of a real corpus."""
  d = config.data
  split_names = {"train": d.train_split, "eval": d.eval_split, "test": d.test_split}
  if d.source == "text":
    return {
        key: text.load_split(d.path, split, d.source_lang, d.target_lang)
        for key, split in split_names.items()
    }
  if d.source == "tfds":
    return tfds_source.load_splits(
        d.tfds_name, split_names, d.source_lang, d.target_lang, data_dir=d.tfds_data_dir or None
    )
  raise ValueError(f"config.data.source={d.source!r} is not a corpus of files: 'text' or 'tfds'")


# ----------------------------------------------------------------------------- vocabulary


def load_workdir_tokenizer(workdir: str) -> Tokenizer:
  """The vocabulary a run stored in `workdir` (whichever kind it is), e.g. for translation."""
  word, spm = os.path.join(workdir, WORD_VOCAB), os.path.join(workdir, SPM_VOCAB)
  if os.path.exists(word) and os.path.exists(spm):
    raise ValueError(
        f"{workdir} holds two vocabularies, {WORD_VOCAB} and {SPM_VOCAB}; a run writes one. "
        "Delete the one its checkpoints were not trained with."
    )
  if os.path.exists(spm):
    return SentencePieceTokenizer(spm)
  if os.path.exists(word):
    return WordTokenizer.load(word)
  raise FileNotFoundError(
      f"{workdir} holds no vocabulary ({WORD_VOCAB} or {SPM_VOCAB}): is it the --workdir of a "
      "training run? Training writes the vocabulary there before the first step."
  )


def word_tokenizer(tokenizer: WordTokenizer, workdir: str | None) -> WordTokenizer:
  """Stores the synthetic task's vocabulary in the workdir, or checks it against the stored one."""
  if workdir is None:
    return tokenizer
  path = os.path.join(workdir, WORD_VOCAB)
  if os.path.exists(path):
    saved = WordTokenizer.load(path)
    if saved.words != tokenizer.words:
      raise ValueError(
          f"{path} is not the vocabulary of this synthetic task (config.data.synthetic_seed "
          "changed?): the workdir's checkpoints were trained on other token ids. Use a new "
          "--workdir, or the config it was created with."
      )
    logging.info("data: reusing the vocabulary in %s", path)
    return saved
  if _is_chief():
    atomic_write(path, tokenizer.save)
  return tokenizer


def sentencepiece_tokenizer(
    train_pairs: list[Pair], workdir: str | None, *, vocab_size: int, max_sentences: int
) -> SentencePieceTokenizer:
  """The workdir's SentencePiece model if there is one; else one trained on `train_pairs`.

  With several processes, process 0 trains and writes, the others wait for it and load the
  file: every host must tokenize with the same model, and the workdir is shared storage anyway
  (checkpoints need it).
  """
  if workdir is None:
    with tempfile.TemporaryDirectory() as tmp:
      return _train(train_pairs, os.path.join(tmp, "vocab"), vocab_size, max_sentences)
  path = os.path.join(workdir, SPM_VOCAB)
  if not os.path.exists(path) and _is_chief():
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:  # same filesystem: atomic rename
      _train(train_pairs, os.path.join(tmp, "vocab"), vocab_size, max_sentences)
      os.replace(os.path.join(tmp, "vocab.model"), path)
  _wait_for_chief("transformer_jax: vocabulary written")
  tokenizer = SentencePieceTokenizer(path)
  logging.info("data: SentencePiece vocabulary %s", path)
  if tokenizer.vocab_size != vocab_size:
    raise ValueError(
        f"{path} has {tokenizer.vocab_size} pieces but config.data.vocab_size={vocab_size}: the "
        "workdir's vocabulary is fixed by its first run. Set "
        f"--config.data.vocab_size={tokenizer.vocab_size}, or use a new --workdir."
    )
  return tokenizer


def spm_training_sample(pairs: list[Pair], max_sentences: int) -> list[str]:
  """Both sides of a seeded random sample of pairs: at most `max_sentences` sentences.

  Random rather than the first pairs, because corpora like WMT are concatenations of very
  different sources (Europarl, then Common Crawl, then news).
  """
  num_pairs = min(len(pairs), max(1, max_sentences // 2))
  if num_pairs < len(pairs):
    chosen = np.random.default_rng(_SPM_SAMPLE_SEED).choice(len(pairs), num_pairs, replace=False)
    pairs = [pairs[i] for i in np.sort(chosen)]
  return [sentence for pair in pairs for sentence in pair]


def _train(pairs, model_prefix, vocab_size, max_sentences) -> SentencePieceTokenizer:
  sentences = spm_training_sample(pairs, max_sentences)
  start = time.perf_counter()
  try:
    tokenizer = train_sentencepiece(
        sentences, model_prefix, vocab_size, model_type=SPM_MODEL_TYPE, max_sentences=len(sentences)
    )
  except RuntimeError as e:  # SentencePiece says e.g. "Vocabulary size too high (8000) ..."
    raise ValueError(
        f"config.data.vocab_size={vocab_size}: SentencePiece could not train on {len(sentences)} "
        f"sentences ({e}). Lower vocab_size, or raise config.data.spm_max_sentences."
    ) from e
  logging.info(
      "data: trained a %s SentencePiece vocabulary of %d on %d sentences in %.1fs",
      SPM_MODEL_TYPE,
      vocab_size,
      len(sentences),
      time.perf_counter() - start,
  )
  return tokenizer


def _tokenize(tokenizer: Tokenizer, pairs: list[Pair]) -> list[batching.Example]:
  return [(tokenizer.encode(src), tokenizer.encode(tgt)) for src, tgt in pairs]


def _is_chief() -> bool:
  import jax  # here, not at the top: only runs with a workdir need a backend

  return jax.process_index() == 0


def _wait_for_chief(tag: str) -> None:
  import jax

  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(tag)


def atomic_write(path: str, write) -> None:
  """`write(tmp_path)` then a rename: a reader never sees half a file."""
  tmp = f"{path}.tmp{os.getpid()}"
  write(tmp)
  os.replace(tmp, path)
