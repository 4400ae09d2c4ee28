"""Prepared corpora: each split tokenized once into flat int32 arrays, memory-mapped on every open.

A corpus is prepared into `cache_dir` once -- by `python -m transformer_jax.prepare_data`, or by the
first training run that finds it missing -- and every later start, resume, host or Table 3 row with
the same data opens it in a second, reading only the pages its batches touch:

    cache_dir/
      <source>-<vocab key>/          one vocabulary and everything encoded with it
        vocab.model                  the joint SentencePiece model (§3.4, §5.1)
        manifest.json                what the key was made of: source fingerprint, vocab settings
        <split>-<split key>/         one split, e.g. train-3f2a..., validation-91c0...
          manifest.json              key inputs, counts, the vocabulary's sha256, and each
                                     file's size and sampled checksum (`file_record`)
          source.npy  source_offsets.npy    [T] int32 ids (no EOS/BOS), [N + 1] int64 starts
          target.npy  target_offsets.npy
          source_text.npy  source_text_offsets.npy  [bytes] uint8 UTF-8 (stripped), [N + 1] int64
          target_text.npy  target_text_offsets.npy

Keys are sha256 digests of JSON: the vocabulary's key holds the training split's fingerprint (a
TFDS dataset's full name and version; for text files their size and hashes of their first and last
MiB), the languages and the vocabulary settings (size, model type, sample size and seed), or, for a
vocabulary given by a workdir, that model's own sha256. A split's key adds its own fingerprint. Each
directory is written under a temporary name and renamed into place, so a kill at any moment leaves
no directory or a complete one; on open, the manifest must repeat the key inputs and the vocabulary
digest, or the cache is refused. Before use, each file of a split must have the size and sampled
checksum its manifest records (`check_split`): a damaged split -- or one whose manifest records
none -- is set aside and prepared again, with a warning naming the file; a vocabulary whose sha256
differs is an error, since its splits were encoded with it.

Nothing holds the corpus as Python objects: the source is read in chunks of `_CHUNK_PAIRS` pairs,
encoded by SentencePiece's multi-threaded batch encode and appended to the arrays on disk.

Sentences are stored whole; `max_len` truncation happens at batching (batching.py), so configs that
differ only in max_len (or in batching) share one prepared corpus.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import hashlib
import itertools
import json
import logging
import os
import shutil
import socket
import time
from collections.abc import Callable, Iterator

import numpy as np

from transformer_jax import errors, files
from transformer_jax.data import text, tfds_source
from transformer_jax.data.tokenizer import SentencePieceTokenizer, train_sentencepiece

Pair = tuple[str, str]

FORMAT_VERSION = 1  # bump when the layout changes: old caches are then never opened
SPM_MODEL_TYPE = "bpe"  # the paper's byte-pair encoding (§5.1)
# Fixed, not config.seed: runs that differ only in seed should share a vocabulary.
SPM_SAMPLE_SEED = 0
VOCAB_FILE = "vocab.model"
_CHUNK_PAIRS = 65_536  # pairs per encode call: big enough for threads, small in memory
_HASH_BYTES = 1 << 20  # the head and the tail of a text file that its fingerprint hashes
_SIDES = ("source", "target")
_ARRAYS = ("source", "target", "source_text", "target_text")
# A split's files; the manifest records each one's size and a hash of sampled blocks.
SPLIT_FILES = tuple(f"{name}{suffix}.npy" for name in _ARRAYS for suffix in ("", "_offsets"))
_SAMPLE_BLOCKS = 16  # blocks a file's checksum hashes: evenly spaced, the first and last included
_SAMPLE_BLOCK_BYTES = 4096


class CacheError(errors.UserError):
  """A prepared directory does not match what it should hold; the message names it."""


# ----------------------------------------------------------------------------- arrays


class TokenArrays:
  """N sequences as one flat array `tokens` [T] and `offsets` [N + 1]: sequence i is
  tokens[offsets[i]:offsets[i + 1]]. Memory-mapped arrays stay on disk until indexed."""

  def __init__(self, tokens: np.ndarray, offsets: np.ndarray):
    self.tokens = tokens
    self.offsets = offsets

  def __len__(self) -> int:
    return len(self.offsets) - 1

  @property
  def lengths(self) -> np.ndarray:
    return np.diff(self.offsets)  # [N]

  def __getitem__(self, i: int) -> np.ndarray:
    i = _check_index(i, len(self))
    return self.tokens[self.offsets[i] : self.offsets[i + 1]]

  @classmethod
  def from_sequences(cls, seqs, dtype=np.int32) -> TokenArrays:
    """From lists of ids, or from `bytes` (dtype uint8: joined, not iterated, ~20x faster)."""
    lengths = np.fromiter(map(len, seqs), dtype=np.int64, count=len(seqs))
    offsets = np.zeros(len(seqs) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if seqs and isinstance(seqs[0], bytes):
      tokens = np.frombuffer(b"".join(seqs), np.uint8)
    else:
      tokens = np.fromiter(itertools.chain.from_iterable(seqs), dtype, count=int(offsets[-1]))
    return cls(tokens, offsets)


class _Pairs(collections.abc.Sequence):
  """Pairs of a split, item i made from sequence i of two TokenArrays (`_item`) on demand."""

  def __init__(self, source: TokenArrays, target: TokenArrays):
    if len(source) != len(target):
      raise ValueError(f"{len(source)} source but {len(target)} target sequences")
    self.source, self.target = source, target

  def __len__(self) -> int:
    return len(self.source)

  def __getitem__(self, i):
    if isinstance(i, slice):
      return [self[j] for j in range(*i.indices(len(self)))]
    return self._item(self.source[i]), self._item(self.target[i])

  def _item(self, values: np.ndarray):
    raise NotImplementedError


class Examples(_Pairs):
  """(source ids, target ids) of a split, as lists.

  batching.py recognises it and batches straight from the arrays; anything else sees a sequence
  of pairs of lists, like the examples of an in-memory corpus."""

  def _item(self, values: np.ndarray) -> list[int]:
    return values.tolist()

  def __eq__(self, other) -> bool:
    if isinstance(other, Examples):
      return all(
          np.array_equal(a.offsets, b.offsets) and np.array_equal(a.tokens, b.tokens)
          for a, b in ((self.source, other.source), (self.target, other.target))
      )
    return NotImplemented


class TextPairs(_Pairs):
  """(source, target) strings of a split, decoded from memory-mapped UTF-8."""

  def _item(self, values: np.ndarray) -> str:
    return values.tobytes().decode("utf-8")

  def __eq__(self, other) -> bool:
    return list(self) == list(other)


def _check_index(i: int, n: int) -> int:
  """i in [0, n), counting from the end when negative; IndexError (which ends iteration) else."""
  i = int(i)
  if not -n <= i < n:
    raise IndexError(f"index {i} out of range for {n} sequences")
  return i + n if i < 0 else i


@dataclasses.dataclass
class PreparedSplit:
  directory: str
  examples: Examples
  pairs: TextPairs
  manifest: dict


# ----------------------------------------------------------------------------- sources


@dataclasses.dataclass(frozen=True)
class SplitSource:
  """Where one split's pairs come from: a fingerprint for the cache key and a chunked reader."""

  fingerprint: dict
  # chunks(size) yields (rows, pairs): pairs stripped, those with an empty side skipped, rows
  # their row numbers (from 0, before skipping); errors name the file and line, or the example.
  chunks: Callable[[int], Iterator[tuple[list[int], list[Pair]]]]
  num_rows: Callable[[], int]  # rows (line pairs or examples) before skipping, for sampling


def text_split(directory: str, split: str, source_lang: str, target_lang: str) -> SplitSource:
  paths = [text.split_path(directory, split, lang) for lang in (source_lang, target_lang)]
  fingerprint = {
      "kind": "text",
      "split": split,
      "languages": [source_lang, target_lang],
      "files": [_file_fingerprint(p) for p in paths],
  }
  return SplitSource(
      fingerprint=fingerprint,
      chunks=lambda size: text.iter_parallel(paths[0], paths[1], size),
      num_rows=lambda: text.count_lines(paths[0]),
  )


def tfds_split(builder, split: str, source_lang: str, target_lang: str) -> SplitSource:
  fingerprint = {
      "kind": "tfds",
      "dataset": builder.info.full_name,
      "split": split,
      "languages": [source_lang, target_lang],
  }
  return SplitSource(
      fingerprint=fingerprint,
      chunks=lambda size: tfds_source.iter_pairs(builder, split, source_lang, target_lang, size),
      num_rows=lambda: tfds_source.num_examples(builder, split),
  )


def _file_fingerprint(path: str) -> dict:
  """Size and sha256 of the first and last MiB: changes with any edit that moves a byte, and
  costs two reads whatever the file's size (a full hash of 36M pairs would take a minute)."""
  try:
    size = os.path.getsize(path)
    digest = hashlib.sha256()
    with open(path, "rb") as f:
      digest.update(f.read(_HASH_BYTES))
      if size > _HASH_BYTES:
        f.seek(max(_HASH_BYTES, size - _HASH_BYTES))
        digest.update(f.read(_HASH_BYTES))
  except FileNotFoundError:
    raise text.MissingFileError(text.missing_message(path)) from None
  return {"name": os.path.basename(path), "size": size, "sha256_head_tail": digest.hexdigest()}


def is_complete(directory: str) -> bool:
  """Whether a prepared directory exists: its manifest is written last, before the rename."""
  return os.path.exists(os.path.join(directory, "manifest.json"))


def vocab_sha256(vocab_directory: str) -> str:
  return _read_json(os.path.join(vocab_directory, "manifest.json"))["vocab_sha256"]


def check_vocab(vocab_directory: str) -> None:
  """A CacheError unless the directory's vocabulary is the file its manifest records."""
  path = os.path.join(vocab_directory, VOCAB_FILE)
  if not os.path.isfile(path) or sha256_file(path) != vocab_sha256(vocab_directory):
    raise CacheError(
        f"{path} is missing or not the vocabulary its manifest records (sha256): the prepared "
        f"vocabulary is damaged. Delete {vocab_directory} (its splits were encoded with it); the "
        "same command prepares them again."
    )


def _key(inputs: dict) -> str:
  return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]


def sha256_file(path: str) -> str:
  with open(path, "rb") as f:
    return hashlib.sha256(f.read()).hexdigest()


def file_record(path: str) -> dict:
  """A prepared file's size and the sha256 of `_SAMPLE_BLOCKS` evenly spaced 4 KiB blocks (the
  whole file when it is smaller): cheap on every open whatever the corpus's size (64 KiB read per
  file), it finds a truncated or extended file always and damage inside a block it samples."""
  size = os.path.getsize(path)
  digest = hashlib.sha256(str(size).encode())
  with open(path, "rb") as f:
    if size <= _SAMPLE_BLOCKS * _SAMPLE_BLOCK_BYTES:
      digest.update(f.read())
    else:
      for offset in np.linspace(0, size - _SAMPLE_BLOCK_BYTES, _SAMPLE_BLOCKS).astype(np.int64):
        f.seek(int(offset))
        digest.update(f.read(_SAMPLE_BLOCK_BYTES))
  return {"size": size, "sha256_sampled": digest.hexdigest()}


# ----------------------------------------------------------------------------- vocabulary


@dataclasses.dataclass(frozen=True)
class VocabSpec:
  """How the vocabulary is made: trained on a sample of the training split, or given as a file."""

  vocab_size: int
  max_sentences: int
  given: str | None = None  # path of an existing SentencePiece model (a workdir's)

  def key_inputs(self, train: SplitSource) -> dict:
    if self.given is not None:
      return {"format": FORMAT_VERSION, "vocab_sha256": sha256_file(self.given)}
    return {
        "format": FORMAT_VERSION,
        "train": train.fingerprint,
        "vocab_size": self.vocab_size,
        "model_type": SPM_MODEL_TYPE,
        "max_sentences": self.max_sentences,
        "sample_seed": SPM_SAMPLE_SEED,
    }


def vocab_dir(cache_dir: str, name: str, spec: VocabSpec, train: SplitSource) -> str:
  tag = "given" if spec.given else name.replace("/", "_")
  return os.path.join(cache_dir, f"{tag}-{_key(spec.key_inputs(train))}")


def prepare_vocab(cache_dir: str, name: str, spec: VocabSpec, train: SplitSource) -> str:
  """The vocabulary directory, made (vocabulary trained on a seeded sample) if missing."""
  final = vocab_dir(cache_dir, name, spec, train)
  if is_complete(final):
    return final
  with files.atomic_dir(final, is_complete) as tmp:
    model = os.path.join(tmp, VOCAB_FILE)
    start = time.perf_counter()
    if spec.given:
      shutil.copyfile(spec.given, model)
    else:
      sentences = sample_sentences(train, spec.max_sentences)
      _train_vocab(sentences, os.path.join(tmp, "vocab"), spec.vocab_size)
      os.remove(os.path.join(tmp, "vocab.vocab"))
    manifest = {
        "key_inputs": spec.key_inputs(train),
        "vocab_sha256": sha256_file(model),
        "seconds": round(time.perf_counter() - start, 1),
    }
    _write_json(os.path.join(tmp, "manifest.json"), manifest)
  return final


def sample_sentences(train: SplitSource, max_sentences: int) -> list[str]:
  """Both sides of a seeded random sample of at most `max_sentences // 2` rows of the split.

  Random rather than the first pairs, because corpora like WMT are concatenations of very
  different sources (Europarl, then Common Crawl, then news). Streams the split once."""
  rows = train.num_rows()
  want = min(rows, max(1, max_sentences // 2))
  chosen = np.zeros(rows, bool)
  chosen[np.random.default_rng(SPM_SAMPLE_SEED).choice(rows, want, replace=False)] = True
  sentences = []
  for rows, pairs in train.chunks(_CHUNK_PAIRS):
    for row, pair in zip(rows, pairs):
      if chosen[row]:
        sentences.extend(pair)
  return sentences


def _train_vocab(sentences: list[str], model_prefix: str, vocab_size: int) -> None:
  start = time.perf_counter()
  try:
    train_sentencepiece(
        sentences,
        model_prefix,
        vocab_size,
        model_type=SPM_MODEL_TYPE,
        max_sentences=len(sentences),
    )
  except RuntimeError as e:  # SentencePiece says e.g. "Vocabulary size too high (8000) ..."
    raise errors.UserError(
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


# ----------------------------------------------------------------------------- splits


def split_dir(vocab_directory: str, key: str, source: SplitSource) -> str:
  vocab_sha = vocab_sha256(vocab_directory)
  inputs = {"format": FORMAT_VERSION, "source": source.fingerprint, "vocab_sha256": vocab_sha}
  return os.path.join(vocab_directory, f"{key}-{_key(inputs)}")


def prepare_split(
    vocab_directory: str, key: str, source: SplitSource, num_threads: int = -1
) -> str:
  """The split's directory, tokenized into it if missing (or set aside by `check_split`)."""
  final = split_dir(vocab_directory, key, source)
  if check_split(final):
    return final
  model = os.path.join(vocab_directory, VOCAB_FILE)
  tokenizer = SentencePieceTokenizer(model)
  start = time.perf_counter()
  with files.atomic_dir(final, is_complete) as tmp:
    writers = {
        name: _ArrayWriter(os.path.join(tmp, name), dtype)
        for name, dtype in (
            ("source", np.int32),
            ("target", np.int32),
            ("source_text", np.uint8),
            ("target_text", np.uint8),
        )
    }
    num_pairs = 0
    for _, chunk in source.chunks(_CHUNK_PAIRS):
      sides = list(zip(*chunk)) if chunk else [(), ()]
      for side, sentences in zip(_SIDES, sides):
        sentences = list(sentences)
        ids = tokenizer.encode_batch(sentences, num_threads=num_threads)
        writers[side].append(ids)
        writers[f"{side}_text"].append([s.encode("utf-8") for s in sentences])
      num_pairs += len(chunk)
    counts = {name: w.close() for name, w in writers.items()}
    manifest = {
        "files": {name: file_record(os.path.join(tmp, name)) for name in SPLIT_FILES},
        "key_inputs": {
            "format": FORMAT_VERSION,
            "source": source.fingerprint,
            "vocab_sha256": sha256_file(model),
        },
        "num_pairs": num_pairs,
        "num_tokens": {side: counts[side] for side in _SIDES},
        "seconds": round(time.perf_counter() - start, 1),
    }
    _write_json(os.path.join(tmp, "manifest.json"), manifest)
  logging.info(
      "data: tokenized %d pairs of %s into %s in %.1fs",
      num_pairs,
      key,
      final,
      time.perf_counter() - start,
  )
  return final


def split_problem(directory: str) -> str | None:
  """What is wrong with a complete prepared split's files, naming the file; None if nothing.

  Each file's size and sampled checksum must be the manifest's (`file_record`), each offsets
  array must start at 0, never decrease and end at its values' count.
  """
  try:
    manifest = _read_json(os.path.join(directory, "manifest.json"))
  except (OSError, ValueError) as e:
    return f"{directory}/manifest.json cannot be read ({e})"
  if not isinstance(manifest.get("files"), dict):
    return f"{directory}/manifest.json records no file sizes or checksums to verify the split by"
  for name in SPLIT_FILES:
    path = os.path.join(directory, name)
    want = manifest["files"].get(name) or {}
    try:
      got = file_record(path)
    except OSError as e:
      return f"{path} cannot be read ({e.strerror or e})"
    if got["size"] != want.get("size"):
      return f"{path} has {got['size']} bytes, its manifest says {want.get('size')}"
    if got != want:
      return f"{path} does not match the checksum its manifest records (damaged bytes)"
  for name in _ARRAYS:
    try:
      tokens = np.load(os.path.join(directory, f"{name}.npy"), mmap_mode="r")
      offsets = np.load(os.path.join(directory, f"{name}_offsets.npy"))
    except (OSError, ValueError) as e:  # a damaged .npy header
      return f"{directory}/{name}.npy or its offsets cannot be read as arrays ({e})"
    if (
        offsets.ndim != 1
        or len(offsets) != manifest.get("num_pairs", -1) + 1
        or offsets[0] != 0
        or offsets[-1] != len(tokens)
        or np.any(offsets[1:] < offsets[:-1])
    ):
      return f"{directory}/{name}_offsets.npy does not describe {name}.npy (damaged values)"
  return None


def check_split(directory: str) -> bool:
  """Whether `directory` holds a complete, intact prepared split. A damaged one (`split_problem`),
  or one whose manifest records no checksums, is set aside, saying why, to be prepared again."""
  if not is_complete(directory):
    return False
  problem = split_problem(directory)
  if problem is None:
    return True
  logging.warning("data: %s: preparing the split again", problem)
  parent, base = os.path.split(directory)
  # A name files.atomic_dir removes once this process is gone, should the removal below be cut
  # short.
  aside = os.path.join(parent, f".tmp-{base}-{socket.gethostname()}-{os.getpid()}-set-aside")
  try:
    os.rename(directory, aside)
  except FileNotFoundError:  # another process set it aside first
    return False
  shutil.rmtree(aside, ignore_errors=True)
  return False


def open_split(directory: str, source: SplitSource, vocab_directory: str) -> PreparedSplit:
  """A prepared split, memory-mapped; refused unless its manifest matches what it should hold."""
  manifest = _read_json(os.path.join(directory, "manifest.json"))
  vocab_sha = vocab_sha256(vocab_directory)
  expected = {"format": FORMAT_VERSION, "source": source.fingerprint, "vocab_sha256": vocab_sha}
  if manifest.get("key_inputs") != expected:
    raise CacheError(
        f"{directory}/manifest.json records {manifest.get('key_inputs')}, not {expected}: this "
        "prepared split belongs to another corpus or vocabulary. Delete the directory; it will be "
        "prepared again."
    )
  arrays = {}
  for name in _ARRAYS:
    try:
      tokens = np.load(os.path.join(directory, f"{name}.npy"), mmap_mode="r")
      offsets = np.load(os.path.join(directory, f"{name}_offsets.npy"))
    except (OSError, ValueError) as e:  # NumPy's words for a truncated or damaged file
      raise CacheError(
          f"{directory}/{name}.npy or {name}_offsets.npy cannot be read ({e}): the prepared split "
          "is damaged. Delete the directory; the same command prepares it again."
      ) from None
    if len(offsets) != manifest["num_pairs"] + 1 or offsets[-1] != len(tokens):
      raise CacheError(
          f"{directory}/{name}.npy holds {len(tokens)} values and {len(offsets) - 1} offsets, "
          f"the manifest says {manifest['num_pairs']} pairs: the directory is damaged. Delete it; "
          "it will be prepared again."
      )
    arrays[name] = TokenArrays(tokens, offsets)
  return PreparedSplit(
      directory=directory,
      examples=Examples(arrays["source"], arrays["target"]),
      pairs=TextPairs(arrays["source_text"], arrays["target_text"]),
      manifest=manifest,
  )


class _ArrayWriter:
  """Appends ragged chunks to `{path}.npy` ([T] values) and keeps the [N + 1] offsets in memory.

  The .npy header is written first with room for any length and rewritten at close, so the values
  stream to disk without a second copy."""

  _HEADER = 128  # bytes: the header of a 1-d array of any length fits, padded to 64

  def __init__(self, path: str, dtype):
    self.path, self.dtype = path, np.dtype(dtype)
    self.file = open(f"{path}.npy", "wb")  # noqa: SIM115 -- open across append() calls; close()
    self.file.write(b"\0" * self._HEADER)
    self.lengths: list[np.ndarray] = []
    self.total = 0

  def append(self, seqs) -> None:
    arrays = TokenArrays.from_sequences(seqs, self.dtype)
    arrays.tokens.tofile(self.file)
    self.lengths.append(np.diff(arrays.offsets))
    self.total += len(arrays.tokens)

  def close(self) -> int:
    header = {
        "descr": np.lib.format.dtype_to_descr(self.dtype),
        "fortran_order": False,
        "shape": (self.total,),
    }
    self.file.seek(0)
    np.lib.format.write_array_header_1_0(self.file, header)
    assert self.file.tell() == self._HEADER, self.file.tell()
    self.file.close()
    lengths = np.concatenate(self.lengths) if self.lengths else np.zeros(0, np.int64)
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    np.save(f"{self.path}_offsets.npy", offsets)
    return self.total


# ----------------------------------------------------------------------------- files


def _write_json(path: str, value: dict) -> None:
  with open(path, "w") as f:
    json.dump(value, f, indent=1, sort_keys=True)


def _read_json(path: str) -> dict:
  try:
    with open(path) as f:
      return json.load(f)
  except ValueError as e:
    raise CacheError(
        f"{path} is not JSON ({e}): the prepared directory is damaged. Delete "
        f"{os.path.dirname(path)}; the same command prepares it again."
    ) from None
