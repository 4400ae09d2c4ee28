"""Checkpoint averaging and the translate CLI, on a tiny run trained for a few steps."""

import io
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import types

import jax
import numpy as np
import pytest

from transformer_jax import average, tune_decoding
from transformer_jax import config as config_lib
from transformer_jax.data.tokenizer import EOS_ID
from transformer_jax.decoding import batch_shapes, saved_programs, search
from transformer_jax.runs import checkpoint, inference
from transformer_jax.tasks import bleu
from transformer_jax.training import train

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow  # ~8 s on 2 cores: .ci/run runs it after the default suite
def test_average_of_checkpoints_is_the_mean_of_their_params(trained_run):
  workdir, results = trained_run
  assert results["parameters"] == "average of steps [3, 4]"
  run = inference.load_run(str(workdir), "latest")
  abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), run.params
  )
  # The full train state (optimizer included), as training restores it, for reference.
  trainer = train.Trainer(run.config, run.model_config, devices=jax.devices()[:1])
  manager = checkpoint.make_manager(str(workdir), keep=3, save_every=1)
  three = [checkpoint.restore(manager, trainer.abstract_state(), s)[0].params for s in (2, 3, 4)]
  manager.close()
  # Inference restores the same parameters, and only them.
  for step, full in zip((2, 3, 4), three):
    alone = inference.restore_params(str(workdir), step, abstract)
    assert jax.tree.structure(alone) == jax.tree.structure(full)
    for a, b in zip(jax.tree.leaves(alone), jax.tree.leaves(full)):
      np.testing.assert_array_equal(a, b)
  saved = checkpoint.load_averaged(str(workdir), abstract)  # written by run()
  for a, b, avg in zip(*(jax.tree.leaves(t) for t in (three[1], three[2], saved))):
    np.testing.assert_allclose(avg, (np.asarray(a) + np.asarray(b)) / 2, rtol=1e-6)
  assert average.average_workdir(str(workdir), 3) == [2, 3, 4]
  saved3 = checkpoint.load_averaged(str(workdir), abstract)
  leaf = lambda tree: np.asarray(jax.tree.leaves(tree)[0])
  np.testing.assert_allclose(leaf(saved3), sum(leaf(t) for t in three) / 3, rtol=1e-6)
  with pytest.raises(ValueError, match="holds 3"):
    average.average_workdir(str(workdir), 5)


def test_default_checkpoint_is_what_the_final_evaluation_used(trained_run, tmp_path):
  workdir, _ = trained_run
  run = inference.load_run(str(workdir), beam_size=1)  # "auto"; the run averages (average_last)
  assert run.checkpoint.startswith("average of steps") and run.checkpoint.endswith("4]")
  # An average that misses the latest checkpoint is stale: "auto" falls back to the latest.
  stale = tmp_path / "stale"
  shutil.copytree(workdir, stale)
  (stale / checkpoint.AVERAGED_DIR / "steps.json").write_text('{"steps": [2, 3]}')
  assert inference.load_run(str(stale), beam_size=1).checkpoint == "step 4"
  assert inference.load_run(str(workdir), "3", beam_size=1).checkpoint == "step 3"
  with pytest.raises(ValueError, match="holds steps"):
    inference.load_run(str(workdir), "1")  # not kept (keep_checkpoints=3)
  with pytest.raises(ValueError, match="expected a step number"):
    inference.load_run(str(workdir), "best")


@pytest.mark.slow  # several first calls: .ci/run runs it after the default suite
def test_decode_lines_keeps_order_empty_lines_and_truncates(trained_run, caplog):
  workdir, _ = trained_run
  run = inference.load_run(str(workdir), "latest", beam_size=1)
  assert run.checkpoint == "step 4"
  train_pairs = (workdir / "test_translations.txt").read_text().splitlines()
  words = run.tokenizer.decode(list(range(4, 30))).split()
  long_line = " ".join(words * 3)  # longer than data.max_len tokens
  lines = ["", " ".join(words[:5]), long_line, "", " ".join(words[5:8])]
  out = run.decode_lines(lines)
  assert len(out) == len(lines) and out[0] == "" and out[3] == ""
  assert "line 3 has" in caplog.text
  # Same sentence alone or among others: same translation (order is restored after bucketing).
  assert run.decode_lines([lines[4]]) == [out[4]]
  assert train_pairs  # the run wrote its test translations


@pytest.mark.slow  # 10-60 s on 2 cores: .ci/run runs it after the default suite
def test_translations_do_not_depend_on_the_references(trained_run):
  """The references' lengths choose no bucket, hence no output length limit (test-set leak)."""
  workdir, _ = trained_run
  run = inference.load_run(str(workdir), "latest", beam_size=2)
  sources = [list(range(4, 4 + n)) for n in (3, 9, 1, 6)]
  buckets = inference.pipeline.eval_bucket_lengths(run.config.data)
  trainer = train.Trainer(run.config, run.model_config)
  short = [(s, [5]) for s in sources]
  long = [(s, [5] * 20) for s in sources]
  out = trainer.decode(run.params, short, buckets, run.tokenizer)
  assert trainer.decode(run.params, long, buckets, run.tokenizer) == out
  assert trainer.decode(run.params, [(s, []) for s in sources], buckets, run.tokenizer) == out
  # The library's batching (sorted by length, sized by tokens; one batch here, padded to the
  # same length) translates them the same.
  assert run.decode_ids(sources) == out
  assert run.decode_ids(sources, batch_tokens=8) == out  # the fewest rows: 8 devices


@pytest.mark.slow  # 5-10 s on 2 cores: .ci/run runs it after the default suite
def test_the_final_evaluation_translates_as_translate_does(trained_run, monkeypatch):
  """results.json's test BLEU comes from the path `translate` takes: the same function, the
  same translations, the same score (the run averaged its checkpoints; "auto" loads that)."""
  workdir, results = trained_run
  calls = []
  original = inference.decode_sources
  monkeypatch.setattr(
      inference, "decode_sources", lambda *a, **k: calls.append(k) or original(*a, **k)
  )
  # Another test re-averages this run's checkpoints; put back the average the run evaluated.
  assert average.average_workdir(str(workdir), 2) == [3, 4]
  run = inference.load_run(str(workdir))
  assert run.checkpoint == results["parameters"] == "average of steps [3, 4]"
  dataset = inference.pipeline.load_dataset(run.config, str(workdir))
  test = dataset.splits["test"]
  hypotheses = run.decode_ids([s for s, _ in test.examples])
  assert calls and calls[-1]["beam_size"] == 2 == run.config.eval.beam_size
  assert hypotheses == (workdir / "test_translations.txt").read_text().splitlines()
  corpus_bleu = bleu.corpus_bleu(hypotheses, [t for _, t in test.pairs])
  assert results["test_bleu"] == pytest.approx(corpus_bleu.score)
  calls.clear()
  trainer = train.Trainer(run.config, run.model_config)
  buckets = inference.pipeline.eval_bucket_lengths(run.config.data)
  assert trainer.decode(run.params, test.examples, buckets, run.tokenizer) == hypotheses
  assert len(calls) == 1  # training's evaluation goes through the same function


@pytest.mark.slow  # several first calls: .ci/run runs it after the default suite
def test_a_sentence_translates_the_same_alone_as_in_a_batch(trained_run):
  """Through the commands' path, greedy and beam (tests/test_beam_search.py shows it on a model
  whose sentences run to their own limits)."""
  workdir, _ = trained_run
  run = inference.load_run(str(workdir), "latest")
  sources = [list(range(4, 4 + n)) for n in (1, 12, 2, 7, 3)]
  limits = [len(s) + 1 + run.config.eval.max_decode_extra for s in sources]
  for beam in (1, 2):
    together = run.decode_ids(sources, beam_size=beam)
    alone = [run.decode_ids([s], beam_size=beam)[0] for s in sources]
    assert alone == together, beam
    lengths = [len(run.tokenizer.encode(h)) for h in together]
    assert all(n <= limit for n, limit in zip(lengths, limits))


def test_shapes_override_the_runs_eval_shapes(trained_run):
  workdir, _ = trained_run
  run = inference.load_run(str(workdir), "latest", shapes="few")
  assert run.config.eval.shapes == "few" and run.predictor.shapes == "few"
  default = inference.load_run(str(workdir), "latest")
  assert default.config.eval.shapes == "auto" and default.predictor.shapes == "auto"  # the run's
  assert batch_shapes.NAMES == ("auto", "fast", "few")  # config validation and --shapes take these
  with pytest.raises(config_lib.ConfigError, match=r"eval\.shapes='fastest': must be one of"):
    inference.load_run(str(workdir), "latest", shapes="fastest")


def test_beam_stop_is_the_runs_unless_overridden(trained_run):
  workdir, _ = trained_run
  default = inference.load_run(str(workdir), "latest")
  assert default.config.eval.beam_stop == "proven" and default.predictor.stop == "proven"
  stopped = default.with_overrides({"eval.beam_stop": "k_finished"})
  assert stopped.predictor.stop == "k_finished" and stopped.params is default.params
  assert batch_shapes.STOPS == ("proven", "k_finished")  # config validation and --beam_stop
  with pytest.raises(config_lib.ConfigError, match=r"eval\.beam_stop='first': must be one of"):
    inference.load_run(str(workdir), "latest", overrides={"eval.beam_stop": "first"})


@pytest.mark.slow  # several first calls: .ci/run runs it after the default suite
def test_auto_shapes_follow_the_calls_sentences_not_its_batch_rows(trained_run, monkeypatch):
  # decode_sources tells the search how many sentences the whole call has: "auto" decodes a
  # call of 2 sentences (in one batch of many more rows) in "few", a call of 3 in "fast", and
  # keeps "fast" from then on; every call's translations equal "fast"'s own.
  workdir, _ = trained_run
  monkeypatch.setattr(batch_shapes, "AUTO_FEW_BELOW", 3)
  run = inference.load_run(str(workdir), "latest")
  fast = inference.load_run(str(workdir), "latest", shapes="fast")
  sources = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
  want = fast.decode_ids(sources)
  stats = {}
  assert run.decode_ids(sources[:2], stats=stats) == want[:2]
  assert stats["batches"] == 1 and stats["rows"] > 3 and not run.predictor.auto_fast
  assert run.decode_ids(sources) == want and run.predictor.auto_fast
  assert run.decode_ids(sources[:1]) == want[:1] and run.predictor.auto_fast


@pytest.mark.subprocess
def test_translate_cli(trained_run, tmp_path):
  workdir, _ = trained_run
  source = tmp_path / "in.txt"
  source.write_text("a b c\n\nd e\n")

  def translate(*extra: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "transformer_jax.translate", "--workdir", str(workdir)]
    command += ["--checkpoint", "avg", "--beam_size", "2", *extra]
    proc = subprocess.run(
        command, input=source.read_text(), capture_output=True, text=True, cwd=REPO, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc

  out = translate().stdout  # the run's eval.shapes: "auto", here "few" (2 sentences)
  assert len(out.splitlines()) == 3 and out.splitlines()[1] == ""
  # --shapes fast: other batch shapes (batch_shapes.py), the same translations.
  assert translate("--shapes", "fast").stdout == out
  # --beam_stop k_finished: the beam stops once 2 hypotheses have finished; a line per line.
  assert len(translate("--beam_stop", "k_finished").stdout.splitlines()) == 3


@pytest.mark.subprocess
def test_translate_without_checkpoint_fails_clearly(tmp_path):
  proc = subprocess.run(
      [sys.executable, "-m", "transformer_jax.translate", "--workdir", str(tmp_path)],
      input="x\n",
      capture_output=True,
      text=True,
      cwd=REPO,
      timeout=120,
  )
  assert proc.returncode == 1
  assert "no config.json" in proc.stderr


def test_tune_decoding_picks_the_beam_and_alpha_with_the_best_validation_bleu(trained_run):
  workdir, _ = trained_run
  result = tune_decoding.tune(str(workdir), [0.0, 1.0], beam_sizes=[1, 2])
  assert [(r["beam_size"], r["alpha"]) for r in result["sweep"]] == [
      (1, 0.0),
      (1, 1.0),
      (2, 0.0),
      (2, 1.0),
  ]
  # The best validation BLEU; on ties the smaller beam, then the smaller α.
  order = sorted(result["sweep"], key=lambda r: (-r["valid_bleu"], r["beam_size"], r["alpha"]))
  assert (result["best_beam_size"], result["best_alpha"]) == (
      order[0]["beam_size"],
      order[0]["alpha"],
  )
  assert json.loads((workdir / "decoding_sweep.json").read_text()) == result
  written = (workdir / "test_translations.tuned.txt").read_text().splitlines()
  assert len(written) == result["test_sentences"]
  # α is an argument of the compiled search: one compilation per (batch shape, beam size), not
  # per α. Shapes: those of the validation batches (both beams), then test's new ones (best beam).
  run = inference.load_run(str(workdir))
  dataset = inference.pipeline.load_dataset(run.config, str(workdir))
  buckets = inference.pipeline.eval_bucket_lengths(run.config.data)

  def shapes(split):
    sources = [s for s, _ in dataset.splits[split].examples]
    return {
        x.shape
        for _, x in inference.decode_batches(
            sources, buckets, inference.DEFAULT_BATCH_TOKENS, jax.device_count()
        )
    }

  assert result["search_compilations"] == 2 * len(shapes("eval")) + len(
      shapes("test") - shapes("eval")
  )
  # Greedy (beam 1) ignores α: both of its rows score the same.
  assert result["sweep"][0]["valid_bleu"] == result["sweep"][1]["valid_bleu"]
  with pytest.raises(ValueError, match=">= 0"):
    tune_decoding.tune(str(workdir), [-1.0])
  with pytest.raises(ValueError, match="beam size must be >= 1"):
    tune_decoding.tune(str(workdir), [0.6], beam_sizes=[0])


def test_attention_figure_of_a_translation(trained_run, tmp_path):
  pytest.importorskip("matplotlib")
  from transformer_jax import plot_attention

  workdir, _ = trained_run
  run = inference.load_run(str(workdir), "latest", beam_size=1)
  sentence = run.tokenizer.decode(list(range(4, 9)))
  output = tmp_path / "attention.png"
  result = plot_attention.figure_for_sentence(
      str(workdir), sentence, layer=-1, which="latest", beam_size=1, output=str(output)
  )
  assert result["translation"] == run.decode_lines([sentence])[0]
  assert result["layer"] == 0 and output.read_bytes()[:4] == b"\x89PNG"
  with pytest.raises(ValueError, match="--layer=3: the model has 1 layers"):
    plot_attention.figure_for_sentence(str(workdir), sentence, layer=3, which="latest")


def test_decode_batches_sort_by_length_and_size_by_tokens():
  rng = np.random.default_rng(0)
  sources = [list(range(4, 4 + n)) for n in rng.integers(1, 40, 300)]
  buckets = (8, 16, 24, 32, 40)
  seen = []
  previous_longest = 0
  for index, inputs in inference.decode_batches(sources, buckets, 512, rows_multiple=4):
    length = inputs.shape[1]
    assert length in buckets and inputs.shape[0] == max(512 // length // 4 * 4, 4)
    real = index[index >= 0]
    assert len(real) and np.all(index[: len(real)] == real)  # filler rows last
    lengths = [min(len(sources[i]) + 1, 40) for i in real]
    assert lengths == sorted(lengths) and lengths[0] >= previous_longest  # sorted overall
    previous_longest = lengths[-1]
    assert max(lengths) <= length and (length == 8 or max(lengths) > length - 8)  # its bucket
    for row, i in enumerate(real):
      ids = sources[i][: length - 1] + [1]
      np.testing.assert_array_equal(inputs[row, : len(ids)], ids)
      assert np.all(inputs[row, len(ids) :] == 0)
    assert np.all(inputs[len(real) :] == inputs[0])  # filler: a copy of the first sentence
    seen.extend(real.tolist())
  assert sorted(seen) == list(range(len(sources)))


def test_translate_reads_a_file_saved_with_a_byte_order_mark_as_one_without(tmp_path):
  """The command's reading path (cli.read_lines into _translate_stream): the run is handed the
  lines without the mark, which would otherwise be read as part of the first word."""
  from transformer_jax import cli, translate

  class Recorder:  # the run's side of _translate_stream: what it is asked to translate

    def __init__(self):
      self.lines = []

    def decode_lines(self, lines, batch_tokens=None):
      self.lines += lines
      return [line.upper() for line in lines]

  source = tmp_path / "in.txt"
  source.write_bytes("\ufeffa b c\r\n\nd e\n".encode())
  run, target = Recorder(), io.StringIO()
  args = types.SimpleNamespace(chunk_lines=2, batch_tokens=None)
  with open(source, "rb") as f:
    counts = translate._translate_stream(run, cli.read_lines(f, str(source)), target, args)
  assert run.lines == ["a b c", "", "d e"] and counts[:2] == (3, 2)
  assert target.getvalue() == "A B C\n\nD E\n"


@pytest.mark.slow  # 10-60 s on 2 cores: .ci/run runs it after the default suite
def test_translate_reads_in_chunks_and_names_a_line_that_is_not_utf8(trained_run, tmp_path):
  workdir, _ = trained_run
  source = tmp_path / "in.txt"
  source.write_bytes(b"a b c\n\nd e\nb c d e\r\nc\n")
  common = [
      sys.executable,
      "-m",
      "transformer_jax.translate",
      "--workdir",
      str(workdir),
      "--beam_size",
      "2",
      "--compilation_cache=",  # off: this test is about reading and writing
  ]
  whole = subprocess.run(
      common + ["--input", str(source)], capture_output=True, text=True, cwd=REPO, timeout=300
  )
  assert whole.returncode == 0, whole.stderr[-2000:]
  assert len(whole.stdout.splitlines()) == 5
  assert "sentences/s" in whole.stderr.splitlines()[-1]
  assert "0 loaded from the compilation cache (off)" in whole.stderr
  chunked = subprocess.run(
      common + ["--chunk_lines", "2", "--output", str(tmp_path / "o.txt")],
      input=source.read_bytes(),
      capture_output=True,
      cwd=REPO,
      timeout=300,
      check=False,
  )
  assert chunked.returncode == 0, chunked.stderr[-2000:]
  assert (tmp_path / "o.txt").read_text() == whole.stdout  # same lines, same order

  bad = tmp_path / "latin1.txt"
  bad.write_bytes("a b\nNaïve café\n".encode("latin-1"))
  for extra, kwargs, name in (
      (["--input", str(bad)], {}, str(bad)),
      ([], {"input": bad.read_bytes()}, "standard input"),
  ):
    proc = subprocess.run(
        common + extra, capture_output=True, cwd=REPO, timeout=300, check=False, **kwargs
    )
    assert proc.returncode == 1
    last = proc.stderr.decode().strip().splitlines()[-1]
    assert last.startswith(f"error: {name} line 2 is not valid UTF-8"), last


@pytest.mark.subprocess
def test_translate_uses_the_users_jax_compilation_cache_dir(trained_run, tmp_path):
  """JAX_COMPILATION_CACHE_DIR, set for JAX itself, is where translate keeps its programs: a
  second call loads them all and translates the same."""
  workdir, _ = trained_run
  source = tmp_path / "in.txt"
  source.write_text("a b c\n\nd e f g h\n")
  cache = tmp_path / "jax_cache"
  env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(cache)}
  command = [sys.executable, "-m", "transformer_jax.translate", "--workdir", str(workdir)]
  command += ["--beam_size", "2", "--input", str(source)]

  def translate():
    proc = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    found = re.search(
        r"programs: (\d+) loaded from the compilation cache \((.*)\), (\d+) compiled; "
        r"(\d+) read exported, (\d+) exported",
        proc.stderr,
    )
    assert found and found.group(2) == str(cache), proc.stderr[-2000:]
    return proc.stdout, *(int(found.group(i)) for i in (1, 3, 4, 5))

  first, loaded, compiled, read, exported = translate()
  assert len(first.splitlines()) == 3 and loaded == 0 and compiled > 0
  assert read == 0 and exported > 0  # the searches' programs, kept as jax.export files
  programs = cache / saved_programs.SUBDIR
  kept = {p.name for p in cache.iterdir()} | {p.name for p in programs.iterdir()}
  assert len(kept) >= compiled + exported
  again, loaded, compiled_again, read, exported_again = translate()
  assert again == first and loaded > 0 and compiled_again == 0
  assert read == exported and exported_again == 0  # nothing traced again
  assert {p.name for p in cache.iterdir()} | {p.name for p in programs.iterdir()} == kept
  # Bytes overwritten in the middle of every saved program (a disk error, a copy cut short):
  # each is set aside with one warning line, exported again, and the call translates the same.
  names = sorted(p.name for p in programs.iterdir())
  for name in names:
    data = (programs / name).read_bytes()
    middle = len(data) // 2
    (programs / name).write_bytes(data[:middle] + b"\xff" * 16 + data[middle + 16 :])
  proc = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
  assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
  assert proc.stdout == first
  for name in names:
    assert sum(f"{programs / name} unreadable" in line for line in proc.stderr.splitlines()) == 1
    assert (programs / (name + saved_programs.SET_ASIDE)).exists()
  assert translate()[0] == first  # written again whole: the next call reads them all


def _benchmark(script: str, workdir, *args) -> dict:
  """The one JSON line of benchmarks/`script` on the run in `workdir`, beam 2, 256-token batches."""
  proc = subprocess.run(
      [sys.executable, f"benchmarks/{script}", f"--workdir={workdir}", "--beam_size=2"]
      + ["--batch_tokens=256", *args],
      capture_output=True,
      text=True,
      cwd=REPO,
      timeout=600,
      check=False,
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # 10-60 s on 2 cores: .ci/run runs it after the default suite
def test_decode_profile_names_where_a_step_spends_its_time(trained_run):
  """benchmarks/profile_decode.py: every traced XLA operation of the search's programs is given
  to a part of the step by its JAX source op, and the parts are the model's and the search's."""
  workdir, _ = trained_run
  result = _benchmark("profile_decode.py", workdir, "--limit=16")
  assert result["sentences"] == 16 and result["steps"] >= 1 and result["event_s"] > 0
  assert result["processor"] and result["cpus"] >= 1
  shares = result["parts_share"]
  assert sum(shares.values()) == pytest.approx(1.0, abs=0.01)
  for part in ("encoder", "self_attention_over_cache", "ffn", "layer_norm", "search"):
    assert shares.get(part, 0) > 0, shares  # the reader found each (an empty map cannot pass)
  assert shares.get("other", 0) < 0.2, shares  # nearly every operation is named
  assert result["step_flops_per_row"] > 0


@pytest.mark.slow  # 10-60 s on 2 cores: .ci/run runs it after the default suite
def test_beam_work_counts_each_sentences_steps_to_its_stop(trained_run, tmp_path):
  """benchmarks/beam_work.py: the steps each rule searches a sentence for are the reference beam
  search's on that sentence alone (`search.beam_search`), and the bound's FLOPs follow them."""
  workdir, _ = trained_run
  run = inference.load_run(workdir)
  lines = ["a b c d", "e f g h i j k", "b c", "l m n o p q r s t", "c d e"]
  sources = tmp_path / "sources.txt"
  sources.write_text("".join(line + "\n" for line in lines))
  result = _benchmark("beam_work.py", workdir, f"--input={sources}")
  assert result["sentences"] == len(lines) and result["beam_size"] == 2
  assert result["gemm_gflops_per_s"] > 0
  want = dict.fromkeys(batch_shapes.STOPS, 0)
  for ids in run.encode_lines(lines):
    inputs = np.array([ids + [EOS_ID]], np.int32)
    n = min(inputs.shape[1] + run.predictor.max_decode_extra, run.model_config.max_len)
    for stop in batch_shapes.STOPS:
      *_, steps = search.beam_search(
          run.predictor.decoder, run.params, inputs, n, 2, run.alpha, best_only=True, stop=stop
      )
      want[stop] += int(steps) - 1  # the steps after the first (BOS) step
  assert want["proven"] > 0
  for stop in batch_shapes.STOPS:
    r = result[stop]
    assert r["sentence_steps"] == want[stop], (stop, r, want)
    assert r["hypothesis_steps"] == 2 * r["sentence_steps"]
    bound = r["matmul_gflop"] / result["gemm_gflops_per_s"]
    assert r["matmul_bound_s"] == pytest.approx(bound, rel=0.01)
  proven, stopped = result["proven"], result["k_finished"]
  assert stopped["sentence_steps"] <= proven["sentence_steps"]
  assert stopped["matmul_gflop"] <= proven["matmul_gflop"]
  # A sentence not done has at least its best alive hypothesis able to win.
  assert proven["sentence_steps"] <= proven["live_hypothesis_steps"] <= proven["hypothesis_steps"]


@pytest.mark.slow  # 10-60 s on 2 cores: .ci/run runs it after the default suite
def test_decode_benchmark_reports_speed_memory_steps_and_device(trained_run):
  workdir, _ = trained_run
  result = _benchmark("decode.py", workdir, "--repeats=1")
  assert result["device"] and result["batch_tokens"] == 256 and result["peak_rss_gib"] > 0
  assert result["processor"] and result["cpus"] >= 1  # the CPU by name (benchmarks/machine.py)
  for mode in ("greedy", "beam2"):
    r = result[mode]
    assert r["sentences_per_s"] > 0 and r["sentences"] == len(
        (workdir / "test_translations.txt").read_text().splitlines()
    )
    # Each batch runs at least one decoder step per position it emits; the time per step is the
    # median pass's seconds over the steps of all batches.
    assert r["steps"] >= r["batches"] >= 1 and r["row_steps"] >= r["rows"]
    rounding = 0.5 / r["steps"] + 0.005  # seconds and step_ms are rounded in the JSON
    assert r["step_ms"] == pytest.approx(1000 * r["seconds"] / r["steps"], abs=rounding)
