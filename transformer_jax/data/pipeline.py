"""From `config.data` to a tokenizer and tokenized splits.

`load_dataset(config, workdir)` returns a `Dataset` holding the tokenizer and, per split, the raw
pairs (for the references) and their token ids (for batching). The trainer, the evaluation code
and the benchmarks all go through here; the run's task (tasks/) reads its data.

The parallel corpora (`load_corpus`, `config.data.source`):
  synthetic  the generated task of data/synthetic.py, with its fixed word vocabulary, in memory
  text       a directory of line-aligned `{split}.{lang}` files (data/text.py)
  tfds       a TFDS translation dataset such as 'wmt14_translate/de-en' (data/tfds_source.py)

Real corpora (text, tfds) are prepared once into `config.data.cache_dir` (data/prepared.py): one
joint SentencePiece model (§3.4, §5.1: source and target share one vocabulary) trained on a random
sample of at most `config.data.spm_max_sentences` training sentences of both sides, and each split
tokenized into flat int32 arrays that every later load memory-maps. With several processes,
process 0 prepares and the others wait for it, then open the same directory (shared storage), or
prepare their own copy with the same vocabulary (a host-local cache_dir).

The vocabulary also belongs to the workdir: the first run stores it there (`vocab.txt` for the word
vocabulary, `vocab.model` for SentencePiece) and every later load -- a resumed run, translation,
evaluation -- uses that file, so token ids never change under a checkpoint: a prepared corpus made
with another vocabulary is never used for that workdir (it gets one prepared with its own).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import ml_collections

from transformer_jax import errors, files, tasks
from transformer_jax.data import batching, prepared, synthetic, tfds_source
from transformer_jax.data.tokenizer import (
    SentencePieceTokenizer,
    Tokenizer,
    WordTokenizer,
)
from transformer_jax.parallel import distributed

Pair = tuple[str, str]

WORD_VOCAB = "vocab.txt"  # WordTokenizer.save: one token per line
SPM_VOCAB = "vocab.model"  # a SentencePiece model proto
SPLIT_KEYS = ("train", "eval", "test")
# Where prepared corpora go when config.data.cache_dir is unset and there is no workdir.
_CACHE_HOME = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
USER_CACHE_DIR = os.path.join(_CACHE_HOME, "transformer_jax", "prepared")


@dataclasses.dataclass
class Split:
  pairs: Sequence[Pair]  # raw (source, target) sentences
  examples: Sequence[batching.Example]  # token ids, no EOS/BOS (prepared.Examples: memory-mapped)


@dataclasses.dataclass
class Dataset:
  tokenizer: Tokenizer
  splits: dict[str, Split]  # keys: "train", "eval", "test" (or those asked for)
  # One-time costs of load_dataset: {"prepare": s (0 when the cache was there), "open": s}.
  seconds: dict[str, float] = dataclasses.field(default_factory=dict)
  cache_dir: str | None = None  # the prepared corpus's directory (None: synthetic)

  def bucket_lengths(self, data_config: ml_collections.ConfigDict) -> tuple[int, ...]:
    return batching.make_bucket_lengths(
        data_config.max_len,
        num_buckets=data_config.num_buckets,
        multiple=data_config.bucket_step,
    )

  def eval_bucket_lengths(self, data_config: ml_collections.ConfigDict) -> tuple[int, ...]:
    return eval_bucket_lengths(data_config)


def eval_bucket_lengths(data_config: ml_collections.ConfigDict) -> tuple[int, ...]:
  """At most 8 lengths, multiples of 8: evaluation and translation compile a program per shape
  (beam search costs seconds each), while padding there only costs a little decoding time."""
  return batching.make_bucket_lengths(
      data_config.max_len,
      num_buckets=min(data_config.num_buckets, 8),
      multiple=max(data_config.bucket_step, 8),
  )


def default_cache_dir(workdir: str | None) -> str:
  """`prepared/` beside the workdir: on a cluster the workdir is on shared storage, so every host
  finds the cache there, and runs kept side by side (a Table 3 sweep's rows) share it. Without a
  workdir, the user's cache directory."""
  if workdir is None:
    return USER_CACHE_DIR
  return os.path.join(os.path.dirname(os.path.abspath(workdir)), "prepared")


def load_dataset(
    config: ml_collections.ConfigDict,
    workdir: str | None = None,
    splits: Sequence[str] = SPLIT_KEYS,
    task: Any = None,
) -> Dataset:
  """Gets the workdir's vocabulary (or makes it) and the tokenized `splits` of the run's data,
  as its task reads them (`task.load_dataset`: the run's, tasks/; None: `config.task`'s)."""
  if task is None:
    task = tasks.get(config.task)
  if workdir is not None:
    os.makedirs(workdir, exist_ok=True)
  dataset = task.load_dataset(config, workdir, splits)
  if "train" in dataset.splits and not len(dataset.splits["train"].examples):
    raise errors.UserError(f"config.data: the {config.data.source} source gave no training pairs")
  for name, split in dataset.splits.items():
    logging.info("data: %s split has %d pairs", name, len(split.examples))
  return dataset


def load_corpus(
    config: ml_collections.ConfigDict,
    workdir: str | None = None,
    splits: Sequence[str] = SPLIT_KEYS,
) -> Dataset:
  """The parallel corpus of a synthetic, text or tfds source: its vocabulary and `splits`.

  Real corpora are prepared into config.data.cache_dir (default: `default_cache_dir(workdir)`)
  unless already there. `workdir=None` with no cache_dir (notebooks, tests) keeps nothing: the
  corpus is prepared in a temporary directory, memory-mapped, and the directory removed.
  """
  d = config.data
  start = time.perf_counter()
  if d.source == "synthetic":
    task = synthetic.SyntheticTask(
        seed=d.synthetic_seed,
        num_train=d.synthetic_train_size,
        num_valid=d.synthetic_eval_size,
        num_test=d.synthetic_eval_size,
    )
    names = {"train": "train", "eval": "valid", "test": "test"}
    tokenizer = word_tokenizer(task.tokenizer(), workdir)
    out = {}
    for key in splits:
      pairs = task.pairs(names[key])
      out[key] = Split(pairs, [(tokenizer.encode(s), tokenizer.encode(t)) for s, t in pairs])
    return Dataset(tokenizer, out, {"prepare": 0.0, "open": time.perf_counter() - start})
  if d.source in ("text", "tfds"):
    cache_dir = d.cache_dir
    if cache_dir or workdir is not None:
      return _load_prepared(config, workdir, cache_dir or default_cache_dir(workdir), splits)
    with tempfile.TemporaryDirectory() as tmp:  # memory maps outlive the unlinked files
      return _load_prepared(config, None, tmp, splits)
  raise errors.UserError(f"config.data.source={d.source!r}: expected 'synthetic', 'text' or 'tfds'")


def split_sources(
    config: ml_collections.ConfigDict, splits: Sequence[str] = SPLIT_KEYS
) -> dict[str, prepared.SplitSource]:
  """Where each of `splits` (and "train", which the vocabulary comes from) of a real corpus comes
  from (the TFDS dataset is downloaded and prepared if needed)."""
  d = config.data
  names = {"train": d.train_split, "eval": d.eval_split, "test": d.test_split}
  names = {key: split for key, split in names.items() if key == "train" or key in splits}
  if d.source == "text":
    return {
        key: prepared.text_split(d.path, split, d.source_lang, d.target_lang)
        for key, split in names.items()
    }
  if d.source == "tfds":
    builder = tfds_source.prepared_builder(d.tfds_name, d.tfds_data_dir or None)
    tfds_source.check_builder(builder, names, d.source_lang, d.target_lang)
    return {
        key: prepared.tfds_split(builder, split, d.source_lang, d.target_lang)
        for key, split in names.items()
    }
  raise errors.UserError(
      f"config.data.source={d.source!r} is not a corpus of files: 'text' or 'tfds'"
  )


def prepare(
    config: ml_collections.ConfigDict,
    workdir: str | None,
    cache_dir: str,
    splits: Sequence[str] = SPLIT_KEYS,
    sources=None,
) -> tuple[str, bool]:
  """Prepares what is missing (vocabulary, splits) into cache_dir from this process. Returns the
  vocabulary's directory and whether anything was missing. The workdir, if given, gets the
  vocabulary."""
  if workdir is not None:
    _check_workdir_vocab_size(workdir, config.data.vocab_size)
  sources = sources or split_sources(config, splits)
  spec = _vocab_spec(config, workdir, cache_dir, sources["train"])
  vocab_directory = prepared.vocab_dir(cache_dir, _corpus_name(config), spec, sources["train"])
  # A damaged split is set aside to be prepared again (saying so); a damaged vocabulary is an
  # error, as its splits were encoded with it.
  have_vocab = prepared.is_complete(vocab_directory)
  if have_vocab:
    prepared.check_vocab(vocab_directory)
  missing = not have_vocab or not all(
      prepared.check_split(prepared.split_dir(vocab_directory, k, sources[k])) for k in splits
  )
  if missing:
    prepared.prepare_vocab(cache_dir, _corpus_name(config), spec, sources["train"])
    for key in splits:
      prepared.prepare_split(vocab_directory, key, sources[key])
  if workdir is not None and not os.path.exists(os.path.join(workdir, SPM_VOCAB)):
    model = os.path.join(vocab_directory, prepared.VOCAB_FILE)
    files.atomic_write(os.path.join(workdir, SPM_VOCAB), lambda tmp: shutil.copyfile(model, tmp))
  return vocab_directory, missing


def _load_prepared(config, workdir, cache_dir, splits) -> Dataset:
  d = config.data
  start = time.perf_counter()
  sources = split_sources(config, splits)
  if distributed.is_chief():
    vocab_directory, missing = prepare(config, workdir, cache_dir, splits, sources)
  distributed.wait_for_chief("transformer_jax: corpus prepared")
  # The chief's cache may be on another host's disk: then this process prepares its own copy.
  if not distributed.is_chief():
    vocab_directory, missing = prepare(config, workdir, cache_dir, splits, sources)
  prepare_seconds = time.perf_counter() - start if missing else 0.0
  opened = time.perf_counter()
  model = os.path.join(vocab_directory, prepared.VOCAB_FILE)
  tokenizer = SentencePieceTokenizer(model)
  if tokenizer.vocab_size != d.vocab_size:
    raise errors.UserError(
        f"{model} has {tokenizer.vocab_size} pieces but config.data.vocab_size={d.vocab_size}."
    )
  out = {}
  for key in splits:
    directory = prepared.split_dir(vocab_directory, key, sources[key])
    split = prepared.open_split(directory, sources[key], vocab_directory)
    out[key] = Split(split.pairs, split.examples)
  logging.info(
      "data: %s %s (%.1fs), opened in %.1fs",
      "prepared" if missing else "reused",
      vocab_directory,
      prepare_seconds,
      time.perf_counter() - opened,
  )
  seconds = {"prepare": prepare_seconds, "open": time.perf_counter() - opened}
  return Dataset(tokenizer, out, seconds, cache_dir=vocab_directory)


def _corpus_name(config) -> str:
  d = config.data
  return d.tfds_name if d.source == "tfds" else os.path.basename(os.path.normpath(d.path))


def _vocab_spec(config, workdir, cache_dir, train) -> prepared.VocabSpec:
  """The cache's trained vocabulary, unless the workdir holds another one: then that one."""
  d = config.data
  trained = prepared.VocabSpec(d.vocab_size, d.spm_max_sentences)
  given = os.path.join(workdir, SPM_VOCAB) if workdir is not None else None
  if given is None or not os.path.exists(given):
    return trained
  directory = prepared.vocab_dir(cache_dir, _corpus_name(config), trained, train)
  if prepared.is_complete(directory) and (
      prepared.vocab_sha256(directory) == prepared.sha256_file(given)
  ):
    return trained
  logging.info("data: %s is not the cache's trained vocabulary; preparing with it", given)
  return prepared.VocabSpec(d.vocab_size, d.spm_max_sentences, given=given)


def _check_workdir_vocab_size(workdir: str, vocab_size: int) -> None:
  path = os.path.join(workdir, SPM_VOCAB)
  if not os.path.exists(path):
    return
  tokenizer = SentencePieceTokenizer(path)
  if tokenizer.vocab_size != vocab_size:
    raise errors.UserError(
        f"{path} has {tokenizer.vocab_size} pieces but config.data.vocab_size={vocab_size}: the "
        "workdir's vocabulary is fixed by its first run. Set "
        f"--config.data.vocab_size={tokenizer.vocab_size}, or use a new --workdir."
    )


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
  if distributed.is_chief():
    files.atomic_write(path, tokenizer.save)
  return tokenizer
