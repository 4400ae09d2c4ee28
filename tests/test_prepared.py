"""Prepared corpora: tokenized once, memory-mapped on every open, never silently the wrong one."""

import logging
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from test_pipeline import small_corpus, text_config

from transformer_jax.data import batching, pipeline, prepared, text


def cached_config(corpus, cache, vocab_size=120):
  config = text_config(corpus, vocab_size)
  config.data.cache_dir = str(cache)
  return config


def complete_dirs(cache):
  """Every prepared directory under `cache` (vocabulary and split directories)."""
  return sorted(
      os.path.relpath(root, cache) for root, _, files in os.walk(cache) if "manifest.json" in files
  )


def test_prepared_splits_equal_tokenizing_in_memory_and_are_memory_mapped(tmp_path):
  small_corpus(tmp_path)
  dataset = pipeline.load_dataset(cached_config(tmp_path, tmp_path / "cache"))
  tokenizer = dataset.tokenizer
  for key, split in (("train", "train"), ("eval", "valid"), ("test", "test")):
    pairs = text.load_split(str(tmp_path), split, "en", "de")
    got = dataset.splits[key]
    assert list(got.pairs) == pairs
    assert list(got.examples) == [(tokenizer.encode(s), tokenizer.encode(t)) for s, t in pairs]
  arrays = dataset.splits["train"].examples.source
  assert isinstance(arrays.tokens, np.memmap) and arrays.tokens.dtype == np.int32
  assert complete_dirs(tmp_path / "cache") == sorted(
      [os.path.basename(dataset.cache_dir)]
      + [os.path.relpath(d, tmp_path / "cache") for d in _split_dirs(dataset.cache_dir)]
  )


def _split_dirs(vocab_directory):
  return [
      os.path.join(vocab_directory, d)
      for d in os.listdir(vocab_directory)
      if os.path.isdir(os.path.join(vocab_directory, d))
  ]


def test_a_second_load_reuses_the_cache_without_reading_the_corpus(tmp_path, monkeypatch, caplog):
  small_corpus(tmp_path)
  config = cached_config(tmp_path, tmp_path / "cache")
  first = pipeline.load_dataset(config, str(tmp_path / "run"))
  assert first.seconds["prepare"] > 0

  def fail(*args):
    raise AssertionError("the corpus was read again")

  monkeypatch.setattr(text, "iter_parallel", fail)
  with caplog.at_level(logging.INFO):
    second = pipeline.load_dataset(config, str(tmp_path / "run2"))  # another run, same data
  assert second.seconds["prepare"] == 0.0 and "trained a" not in caplog.text
  assert second.splits["train"].examples == first.splits["train"].examples
  assert second.cache_dir == first.cache_dir
  # The vocabulary went to both workdirs, where translation reads it.
  sentence = first.splits["test"].pairs[0][0]
  for run in ("run", "run2"):
    assert pipeline.load_workdir_tokenizer(str(tmp_path / run)).encode(sentence) == (
        first.tokenizer.encode(sentence)
    )


def test_default_cache_is_prepared_beside_the_workdir(tmp_path):
  small_corpus(tmp_path)
  dataset = pipeline.load_dataset(text_config(tmp_path), str(tmp_path / "runs" / "a"))
  assert dataset.cache_dir.startswith(str(tmp_path / "runs" / "prepared") + os.sep)


def test_changed_corpus_or_vocabulary_gets_its_own_cache(tmp_path):
  small_corpus(tmp_path)
  cache = tmp_path / "cache"
  base = pipeline.load_dataset(cached_config(tmp_path, cache))
  other_vocab = pipeline.load_dataset(cached_config(tmp_path, cache, vocab_size=100))
  assert other_vocab.cache_dir != base.cache_dir
  with open(tmp_path / "valid.de", "a", encoding="utf-8") as f:  # one more validation pair
    f.write("NEU\n")
  with open(tmp_path / "valid.en", "a", encoding="utf-8") as f:
    f.write("new\n")
  changed = pipeline.load_dataset(cached_config(tmp_path, cache))
  assert changed.cache_dir == base.cache_dir  # same training data: same vocabulary
  assert len(changed.splits["eval"].pairs) == len(base.splits["eval"].pairs) + 1
  assert changed.splits["eval"].pairs[-1] == ("new", "NEU")


def test_a_workdir_with_another_vocabulary_never_uses_the_cache_of_the_trained_one(tmp_path):
  small_corpus(tmp_path)
  cache = tmp_path / "cache"
  trained = pipeline.load_dataset(cached_config(tmp_path, cache))
  (tmp_path / "other").mkdir()
  small_corpus(tmp_path / "other", seed=1)
  other = pipeline.load_dataset(
      cached_config(tmp_path / "other", tmp_path / "cache2"), str(tmp_path / "run")
  )  # a workdir with other pieces
  dataset = pipeline.load_dataset(cached_config(tmp_path, cache), str(tmp_path / "run"))
  assert dataset.cache_dir != trained.cache_dir
  sentence = dataset.splits["train"].pairs[0][0]
  assert dataset.tokenizer.encode(sentence) == other.tokenizer.encode(sentence)
  assert dataset.splits["train"].examples[0][0] == other.tokenizer.encode(sentence)


def test_a_manifest_that_does_not_match_is_refused(tmp_path):
  small_corpus(tmp_path)
  config = cached_config(tmp_path, tmp_path / "cache")
  dataset = pipeline.load_dataset(config)
  split = next(d for d in _split_dirs(dataset.cache_dir) if os.path.basename(d).startswith("train"))
  manifest = prepared._read_json(os.path.join(split, "manifest.json"))
  manifest["key_inputs"]["vocab_sha256"] = "0" * 64
  prepared._write_json(os.path.join(split, "manifest.json"), manifest)
  with pytest.raises(prepared.CacheError, match=r"train-\w+/manifest.json records .* another"):
    pipeline.load_dataset(config)


def _damage(path, how):
  data = bytearray(path.read_bytes())
  if how == "truncated":
    path.write_bytes(bytes(data[: len(data) - 40]))
  else:  # one byte flipped in the middle, where the values are
    data[len(data) // 2 + 1] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["truncated", "byte-flipped"])
@pytest.mark.parametrize("name", ["source.npy", "target_text_offsets.npy"])
def test_a_damaged_prepared_file_is_named_in_one_line_and_prepared_again(
    tmp_path, caplog, how, name
):
  small_corpus(tmp_path)
  config = cached_config(tmp_path, tmp_path / "cache")
  first = pipeline.load_dataset(config)
  train = next(d for d in _split_dirs(first.cache_dir) if os.path.basename(d).startswith("train"))
  want = (list(first.splits["train"].examples), list(first.splits["train"].pairs))
  path = tmp_path / "cache" / train / name
  _damage(path, how)  # in place: `first`'s memory maps see it too
  source = pipeline.split_sources(config)["train"]
  # Opened as it is, the damage is one CacheError naming the file, never a NumPy traceback.
  if how == "truncated" and name == "source.npy":
    with pytest.raises(prepared.CacheError, match=rf"{name} .*cannot be read .*damaged"):
      prepared.open_split(train, source, first.cache_dir)
  assert name in prepared.split_problem(train)
  with caplog.at_level(logging.INFO):
    again = pipeline.load_dataset(config)
  warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
  assert len(warnings) == 1 and str(path) in warnings[0], warnings
  assert "preparing the split again" in warnings[0]
  assert "tokenized 400 pairs of train" in caplog.text and "tokenized 8" not in caplog.text
  assert prepared.split_problem(train) is None
  assert (list(again.splits["train"].examples), list(again.splits["train"].pairs)) == want


def test_a_split_whose_manifest_has_no_checksums_is_prepared_again_saying_so(tmp_path, caplog):
  small_corpus(tmp_path)
  config = cached_config(tmp_path, tmp_path / "cache")
  first = pipeline.load_dataset(config)
  for split in _split_dirs(first.cache_dir):  # as a cache made without the "files" record
    manifest = prepared._read_json(os.path.join(split, "manifest.json"))
    del manifest["files"]
    prepared._write_json(os.path.join(split, "manifest.json"), manifest)
  with caplog.at_level(logging.WARNING):
    again = pipeline.load_dataset(config)
  assert caplog.text.count("records no file sizes or checksums") == 3
  assert again.splits["test"].examples == first.splits["test"].examples
  assert all(prepared.split_problem(d) is None for d in _split_dirs(first.cache_dir))
  assert not [n for n in os.listdir(first.cache_dir) if n.startswith(".")]  # nothing left aside


def test_a_damaged_vocabulary_or_manifest_is_one_error_naming_it(tmp_path):
  small_corpus(tmp_path)
  config = cached_config(tmp_path, tmp_path / "cache")
  vocab_directory = pipeline.load_dataset(config).cache_dir
  model = os.path.join(vocab_directory, prepared.VOCAB_FILE)
  with open(model, "r+b") as f:
    f.seek(100)
    f.write(b"\0")
  with pytest.raises(prepared.CacheError, match=r"vocab.model is missing or not the vocabulary"):
    pipeline.load_dataset(config)
  with open(os.path.join(vocab_directory, "manifest.json"), "w") as f:
    f.write('{"vocab_sha')
  with pytest.raises(prepared.CacheError, match=r"manifest.json is not JSON .* Delete "):
    pipeline.load_dataset(config)


def test_file_record_samples_a_large_file_and_always_sees_its_size(tmp_path):
  path = tmp_path / "big.npy"
  data = np.random.default_rng(0).integers(0, 255, 10 << 20, np.uint8)
  data.tofile(path)
  record = prepared.file_record(str(path))
  data[0] ^= 1  # inside the first sampled block
  data.tofile(path)
  assert prepared.file_record(str(path)) != record
  data[0] ^= 1
  np.concatenate([data, [7]]).astype(np.uint8).tofile(path)  # one byte more
  assert prepared.file_record(str(path))["size"] == record["size"] + 1


def test_bad_lines_are_named_during_preparation(tmp_path):
  small_corpus(tmp_path)
  with open(tmp_path / "train.de", "ab") as f:
    f.write(b"sch\xf6n\n")
  with open(tmp_path / "train.en", "a") as f:
    f.write("nice\n")
  with pytest.raises(text.CorpusError, match=r"train\.de:401: invalid UTF-8"):
    pipeline.load_dataset(cached_config(tmp_path, tmp_path / "cache"))
  small_corpus(tmp_path)
  with open(tmp_path / "train.en", "a") as f:
    f.write("one more\n")
  with pytest.raises(text.CorpusError, match=r"train\.en has 401 lines but .*train\.de has 400"):
    pipeline.load_dataset(cached_config(tmp_path, tmp_path / "cache"))
  assert not [d for d in complete_dirs(tmp_path / "cache") if "train-" in d]


def test_streaming_in_chunks_gives_the_same_arrays(tmp_path, monkeypatch):
  small_corpus(tmp_path)
  whole = pipeline.load_dataset(cached_config(tmp_path, tmp_path / "a"))
  monkeypatch.setattr(prepared, "_CHUNK_PAIRS", 7)  # many chunks, a partial last one
  chunked = pipeline.load_dataset(cached_config(tmp_path, tmp_path / "b"))
  for key in ("train", "eval", "test"):
    assert chunked.splits[key].examples == whole.splits[key].examples
    assert list(chunked.splits[key].pairs) == list(whole.splits[key].pairs)


@pytest.mark.subprocess
def test_a_killed_preparation_leaves_no_cache_and_the_rerun_finishes_it(tmp_path):
  small_corpus(tmp_path)
  cache = tmp_path / "cache"
  # The child is killed (SIGKILL: no cleanup of any kind) while writing the training split.
  script = textwrap.dedent(f"""
      import os, signal, sys
      sys.path.insert(0, {str(os.path.dirname(__file__))!r})
      from test_prepared import cached_config
      from transformer_jax.data import pipeline, prepared, text
      prepared._CHUNK_PAIRS = 50
      read, calls = text.iter_parallel, []
      def killed(*args):  # the first call samples for the vocabulary, the second tokenizes
        calls.append(args)
        for i, chunk in enumerate(read(*args)):
          if len(calls) == 2 and i == 3:
            os.kill(os.getpid(), signal.SIGKILL)
          yield chunk
      text.iter_parallel = killed
      pipeline.load_dataset(cached_config({str(tmp_path)!r}, {str(cache)!r}))
  """)
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
  proc = subprocess.run(
      [sys.executable, "-c", script],
      env=env,
      capture_output=True,
      text=True,
      timeout=300,
      check=False,
  )
  assert proc.returncode == -9, proc.stderr
  vocab = [d for d in complete_dirs(cache)]
  assert len(vocab) == 1 and "/" not in vocab[0]  # the vocabulary was done; no split is
  leftovers = [n for n in os.listdir(cache / vocab[0]) if n.startswith(".tmp-")]
  assert len(leftovers) == 1  # the killed split's temporary directory

  rerun = pipeline.load_dataset(cached_config(tmp_path, cache))
  assert not [n for n in os.listdir(cache / vocab[0]) if n.startswith(".tmp-")]
  clean = pipeline.load_dataset(cached_config(tmp_path, tmp_path / "clean"))
  for key in ("train", "eval", "test"):
    assert rerun.splits[key].examples == clean.splits[key].examples


def test_batches_from_prepared_arrays_equal_batches_from_lists(tmp_path):
  small_corpus(tmp_path)
  dataset = pipeline.load_dataset(cached_config(tmp_path, tmp_path / "cache"))
  examples = dataset.splits["train"].examples
  kwargs = {
      "seed": 3,
      "bucket_lengths": (8, 16, 24),
      "tokens_per_batch": 192,
      "batch_multiple": 2,
      "process_count": 2,
  }
  for process in range(2):
    mapped = batching.BatchIterator(examples, process_index=process, **kwargs)
    listed = batching.BatchIterator(list(examples), process_index=process, **kwargs)
    for _ in range(2 * mapped.batches_per_epoch):
      a, b = next(mapped), next(listed)
      assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.subprocess
def test_prepare_data_command_prepares_then_reuses_and_reports_errors_in_one_line(tmp_path):
  import json

  small_corpus(tmp_path)
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  command = [
      sys.executable,
      "-m",
      "transformer_jax.prepare_data",
      "--config",
      os.path.join(repo, "configs/quickstart.py:smoke"),
      "--config.data.source=text",
      f"--config.data.path={tmp_path}",
      "--config.data.vocab_size=120",
      f"--workdir={tmp_path / 'runs' / 'a'}",
  ]
  env = {**os.environ, "PYTHONPATH": repo, "JAX_PLATFORMS": "cpu"}

  def run(*extra):
    return subprocess.run(
        [*command, *extra],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=repo,
    )

  first = run()
  assert first.returncode == 0, first.stderr
  report = json.loads(first.stdout.strip().splitlines()[-1])
  assert report["reused"] is False and report["splits"]["train"]["pairs"] == 400
  assert report["prepared"].startswith(str(tmp_path / "runs" / "prepared"))
  assert (tmp_path / "runs" / "a" / pipeline.SPM_VOCAB).exists()  # for translate
  second = json.loads(run().stdout.strip().splitlines()[-1])
  assert second["reused"] is True and second["prepared"] == report["prepared"]
  # A run of train.py with this config finds it: same directory, nothing prepared.
  dataset = pipeline.load_dataset(text_config(tmp_path), str(tmp_path / "runs" / "b"))
  assert dataset.seconds["prepare"] == 0.0 and dataset.cache_dir == report["prepared"]

  bad = run("--config.data.vocab_size=99999")
  assert bad.returncode == 1
  assert bad.stderr.strip().splitlines()[-1].startswith("error: ")


@pytest.mark.subprocess
def test_pipeline_benchmark_prepares_then_reuses(tmp_path):
  import json

  small_corpus(tmp_path, num_pairs=2000)
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  command = [
      sys.executable,
      os.path.join(repo, "benchmarks", "pipeline.py"),
      "--config",
      os.path.join(repo, "configs/quickstart.py:smoke"),
      "--config.data.source=text",
      f"--config.data.path={tmp_path}",
      "--config.data.vocab_size=120",
      f"--config.data.cache_dir={tmp_path / 'cache'}",
      "--config.data.packing=True",
      "--seconds=0.5",
      "--batch_multiple=1",
  ]
  env = {**os.environ, "PYTHONPATH": repo, "JAX_PLATFORMS": "cpu"}
  records = []
  for _ in range(2):
    proc = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    records.append(json.loads(proc.stdout.strip().splitlines()[-1]))
  first, second = records
  for record in records:
    assert record["train_pairs"] == 2000 and record["batches_per_s"] > 0
    assert 0 < record["first_batch_seconds"] < 300 and record["peak_rss_bytes"] > 10**7
    assert record["padding_efficiency"] > 0.9 and record["tokens_per_s"] > 0
    assert record["cache_bytes"] > 2000 * 4
  assert first["prepare_seconds"] > 0 and second["prepare_seconds"] == 0
