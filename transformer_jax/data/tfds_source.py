"""The TFDS source: any TensorFlow Datasets translation dataset, as Python (source, target) strings.

`load_splits("wmt14_translate/de-en", {"train": "train", ...}, "en", "de")` reads WMT'14 as
English→German: the direction comes from the language arguments, not from the dataset's name or
its supervised keys (which for wmt14 de-en are (de, en)). Split names are TFDS's own, so slices
work too ("train[:10%]"). The first call downloads and prepares the dataset into `data_dir`
(default ~/tensorflow_datasets), which for WMT takes hours and tens of GB.

TensorFlow Datasets is an optional dependency (`pip install '.[tfds]'`), imported only here and
only when this source is used.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from typing import Any

Pair = tuple[str, str]

# Examples per tf.data batch: large enough that Python's per-batch overhead vanishes.
_READ_BATCH = 4096


def import_tfds():
  """`tensorflow_datasets`, with an actionable error when it is not installed."""
  try:
    import tensorflow as tf
    import tensorflow_datasets as tfds
  except ImportError as e:
    raise ImportError(
        f"config.data.source='tfds' needs TensorFlow Datasets, which is not installed ({e}). "
        "Install the optional dependencies with `pip install '.[tfds]'` (from the repository "
        "root), or use config.data.source='text' with a directory of {split}.{lang} files."
    ) from e
  try:
    # TensorFlow only reads files here; left alone it would reserve accelerator memory JAX needs.
    tf.config.set_visible_devices([], "GPU")
  except RuntimeError:  # devices were already initialised by someone else; nothing to undo
    pass
  return tfds


def load_splits(
    name: str,
    splits: Mapping[str, str],
    source_lang: str,
    target_lang: str,
    data_dir: str | None = None,
) -> dict[str, list[Pair]]:
  """{key: pairs} for each {key: TFDS split}, downloading and preparing the dataset if needed."""
  return read_builder(prepared_builder(name, data_dir), splits, source_lang, target_lang)


def prepared_builder(name: str, data_dir: str | None = None) -> Any:
  """The dataset's TFDS builder, downloaded and prepared into `data_dir` if it was not yet."""
  tfds = import_tfds()
  try:
    builder = tfds.builder(name, data_dir=data_dir or None)
  except Exception as e:  # TFDS raises its own DatasetNotFoundError and friends
    raise ValueError(
        f"config.data.tfds_name={name!r}: TFDS cannot build this dataset ({e}). Use a name from "
        "https://www.tensorflow.org/datasets/catalog, e.g. 'wmt14_translate/de-en'."
    ) from e
  builder.download_and_prepare()
  return builder


def read_builder(
    builder: Any, splits: Mapping[str, str], source_lang: str, target_lang: str
) -> dict[str, list[Pair]]:
  """Reads prepared splits of a TFDS builder (a registered dataset or a `tfds.TranslateFolder`)."""
  check_builder(builder, splits, source_lang, target_lang)
  out = {}
  for key, split in splits.items():
    out[key] = [
        pair for _, chunk in iter_pairs(builder, split, source_lang, target_lang) for pair in chunk
    ]
  return out


def check_builder(builder: Any, splits, source_lang: str, target_lang: str) -> None:
  """Errors naming the config key when the languages or the splits are not the dataset's."""
  name = builder.info.full_name
  languages = sorted(builder.info.features.keys())
  for key, lang in (("source_lang", source_lang), ("target_lang", target_lang)):
    if lang not in languages:
      raise ValueError(
          f"config.data.{key}={lang!r}: {name} has the languages (features) {languages}; "
          "pick the source and target languages among them."
      )
  # Builders without recorded metadata (tfds.testing.mock_data) know no splits and accept any.
  known = sorted(builder.info.splits.keys())
  for key, split in splits.items():
    base = split.split("[")[0]  # "train[:10%]" -> "train"
    if known and base not in known:
      raise ValueError(
          f"config.data.{key}_split={split!r}: {name} has the splits {known}; set "
          f"--config.data.{key}_split to one of them (TFDS calls the dev set 'validation')."
      )


def iter_pairs(
    builder: Any, split: str, source_lang: str, target_lang: str, chunk_size: int = _READ_BATCH
) -> Iterator[tuple[list[int], list[Pair]]]:
  """(indices, pairs) of a prepared split in chunks: pairs stripped, those with an empty side
  skipped (and counted in a warning), indices their example numbers in the split."""
  tfds = import_tfds()
  name = builder.info.full_name
  ds = builder.as_dataset(split=split, shuffle_files=False).batch(chunk_size)
  num_skipped, index = 0, 0
  for batch in tfds.as_numpy(ds):
    rows, pairs = [], []
    for src, tgt in zip(batch[source_lang], batch[target_lang]):
      src = _decode(src, name, split, index).strip()
      tgt = _decode(tgt, name, split, index).strip()
      if src and tgt:
        rows.append(index)
        pairs.append((src, tgt))
      else:
        num_skipped += 1
      index += 1
    yield rows, pairs
  if num_skipped:
    logging.warning(
        "data: %s %s: skipped %d of %d pairs with an empty side", name, split, num_skipped, index
    )


def num_examples(builder: Any, split: str) -> int:
  """Examples in a split (slices included), from the metadata, else by counting them."""
  try:
    return int(builder.info.splits[split].num_examples)
  except (KeyError, ValueError, TypeError):
    pass
  ds = builder.as_dataset(split=split, shuffle_files=False).batch(_READ_BATCH)
  first = min(builder.info.features.keys())
  return sum(len(batch[first]) for batch in import_tfds().as_numpy(ds))


def _decode(value: bytes, name: str, split: str, index: int) -> str:
  try:
    return value.decode("utf-8")
  except UnicodeDecodeError as e:
    raise ValueError(
        f"{name} split {split!r}, example {index}: invalid UTF-8 ({e}); the dataset's files are "
        "corrupt, delete its prepared directory and prepare it again."
    ) from None
