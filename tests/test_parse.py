"""The parse command (§6.3): bad input is one `error:` line; a trained run parses end to end."""

import io
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

from configs import parsing_sample
from transformer_jax import config as config_lib
from transformer_jax import errors, parse
from transformer_jax.data import pipeline
from transformer_jax.tasks.parsing import evalb, scoring, trees

REPO = pathlib.Path(__file__).resolve().parents[1]
EVALB_C = REPO.parent / "shared" / "tools" / "evalb" / "evalb.c"


def _read(data: bytes, max_words: int = 5):
  return parse.read_sentences(io.BytesIO(data), "standard input", max_words)


def test_reads_tokenized_sentences_and_escapes_brackets():
  assert _read(b"The dog barks .\r\n( a ) {b}\n") == [
      ["The", "dog", "barks", "."],
      ["-LRB-", "a", "-RRB-", "{b}"],
  ]
  assert scoring.sentence_words("f(x) }") == ["f-LRB-x-RRB-", "-RCB-"]


def test_a_byte_order_mark_opening_the_input_is_not_part_of_the_first_word():
  """Tokenized or plain, a file saved with a UTF-8 BOM reads as the same file without it."""
  text = "A dog barks .\nIt runs .\n"
  for tokenize in (False, True):
    with_mark = parse.read_sentences(io.BytesIO(b"\xef\xbb\xbf" + text.encode()), "f", 8, tokenize)
    assert with_mark == parse.read_sentences(io.BytesIO(text.encode()), "f", 8, tokenize)
    assert with_mark[0][0] == "A"


def test_an_interrupted_parse_command_ends_in_one_line_with_status_130(monkeypatch, capsys):
  """Ctrl-C: no traceback, the shell's status for an interrupted program; the trees are written
  only once all are parsed (an --output file whole, by a rename)."""

  def interrupted(argv):
    raise KeyboardInterrupt

  monkeypatch.setattr(parse, "main", interrupted)
  assert parse._main_or_interrupted(["parse"]) == 130
  assert (
      capsys.readouterr().err == "parse: interrupted (the trees are written once all are parsed)\n"
  )


@pytest.mark.parametrize(
    "data, message",
    [
        (b"The dog barks .\n\nIt runs .\n", r"^standard input line 2 is empty"),
        (b"ok .\n   \t\n", r"^standard input line 2 is empty"),
        (b"a b c d e f\n", r"^standard input line 1 has 6 words; this model reads at most 5"),
        (b"fine .\ncaf\xe9 .\n", r"^standard input line 2 is not valid UTF-8"),
    ],
)
def test_bad_input_names_the_line(data, message):
  with pytest.raises(errors.UserError, match=message):
    _read(data)


def _config_only_workdir(tmp_path, source="ptb") -> pathlib.Path:
  """A workdir holding only config.json: input is checked before anything else is loaded. The
  ptb source: a parsing run; any other: a translation run of the same model."""
  config = parsing_sample.get_config()
  if source != "ptb":
    parsing = config
    config = config_lib.default_config()
    config.model, config.data = parsing.model, parsing.data
  config.data.source = source
  config.data.path = str(tmp_path)
  config.data.max_len = 8
  config.data.packed_source_len = 0  # the config's 96 would not fit rows of 8
  workdir = tmp_path / "run"
  workdir.mkdir()
  (workdir / "config.json").write_text(config.to_json_best_effort())
  return workdir


@pytest.mark.subprocess
@pytest.mark.parametrize(
    "data, message, args",
    [
        (b"The dog barks .\n\n", "error: standard input line 2 is empty", []),
        (
            b"one two three four five six seven eight\n",
            "error: standard input line 1 has 8 words",
            [],
        ),
        (b"\xff\xfe\n", "error: standard input line 1 is not valid UTF-8", []),
        (b"The dog barks .\n", "error: --batch_tokens=0: must be >= 1", ["--batch_tokens=0"]),
    ],
)
def test_parse_cli_bad_input_is_one_error_line(tmp_path, data, message, args):
  workdir = _config_only_workdir(tmp_path)
  proc = subprocess.run(
      [sys.executable, "-m", "transformer_jax.parse", "--workdir", str(workdir), *args],
      input=data,
      capture_output=True,
      cwd=REPO,
      timeout=300,
  )
  stderr = proc.stderr.decode()
  assert proc.returncode == 1 and proc.stdout == b""
  assert stderr.startswith(message) and stderr.count("\n") == 1, stderr


@pytest.mark.subprocess
@pytest.mark.parametrize(
    "command, source, wrong", [("parse", "text", "parsing"), ("translate", "ptb", "translation")]
)
def test_a_command_refuses_another_tasks_run_in_one_line(tmp_path, command, source, wrong):
  """parse given a translation run, translate given a parsing run: one line naming the other."""
  workdir = _config_only_workdir(tmp_path, source=source)
  proc = subprocess.run(
      [sys.executable, "-m", f"transformer_jax.{command}", "--workdir", str(workdir)],
      input=b"a b\n",
      capture_output=True,
      cwd=REPO,
      timeout=300,
  )
  stderr = proc.stderr.decode()
  right = {"parse": "translate", "translate": "parse"}[command]
  assert proc.returncode == 1 and proc.stdout == b"" and stderr.count("\n") == 1, stderr
  assert stderr.startswith(f"error: --workdir={workdir} is a ") and f"not a {wrong} run" in stderr
  assert stderr.rstrip().endswith(f"use python -m transformer_jax.{right} for it"), stderr


def _tiny_sample_config(shared_data):
  """The sample's recipe made tiny: a few articles, a 1-layer d_model-32 model, 60 updates."""
  config = parsing_sample.get_config()
  config.data.path = str(shared_data / "ptb-sample")
  config.data.train_split, config.data.eval_split, config.data.test_split = (
      "0001-0030",
      "0031-0033",
      "0034-0036",
  )
  config.model.d_model, config.model.num_heads, config.model.d_ff = 32, 4, 64
  config.model.num_layers = 1
  config.data.packing = True
  config.data.num_buckets = 2
  config.data.max_len = 128
  config.data.tokens_per_batch = 2048
  config.train.num_steps, config.train.warmup_steps = 60, 20
  config.train.lr_multiplier = 4.0
  config.train.checkpoint_every, config.train.eval_every = 30, 30
  config.train.average_last = 2
  config.train.max_train_minutes = 0.0
  # Room for a well-formed tree with words (two tokens per word) for every sentence here.
  config.eval.beam_size, config.eval.max_decode_extra = 2, 100
  config.eval.num_sentences = 8
  return config


def _parse(workdir, text: str, *args: str) -> subprocess.CompletedProcess:
  """`python -m transformer_jax.parse --workdir WORKDIR ARGS < text`."""
  return subprocess.run(
      [sys.executable, "-m", "transformer_jax.parse", "--workdir", str(workdir), *args],
      input=text.encode(),
      capture_output=True,
      cwd=REPO,
      timeout=600,
  )


@pytest.mark.slow
def test_parsing_end_to_end_on_the_sample(shared_data, tmp_path):
  """A tiny model trained for a minute on a few articles (with word dropout): results.json has
  EVALB's figures, the compiled EVALB agrees on test_trees.mrg / test_gold.mrg, tune_decoding
  chooses the search on validation F1, and the parse command writes one tree per input line over
  exactly the input's words."""
  import jax

  from transformer_jax.training import train

  config = _tiny_sample_config(shared_data)
  config.parsing.word_dropout = 0.1  # trained through the whole run (ptb.drop_words)
  workdir = tmp_path / "run"
  results = train.run(config, str(workdir), devices=jax.devices()[:1])
  for key in ("test_f1", "test_precision", "test_recall", "test_complete_match", "test_repaired"):
    assert key in results
  assert json.loads((workdir / "results.json").read_text())["test_f1"] == results["test_f1"]
  predicted = evalb.read_lines(str(workdir / "test_trees.mrg"))
  gold = evalb.read_lines(str(workdir / "test_gold.mrg"))
  assert len(predicted) == len(gold) == results["test_sentences"]
  for p, g in zip(predicted, gold):
    assert trees.parse_trees(p)[0].words() == trees.parse_trees(g)[0].words()
  compiler = shutil.which("gcc") or shutil.which("cc")
  if compiler is not None and EVALB_C.is_file():
    binary = tmp_path / "evalb"
    subprocess.run([compiler, "-O1", "-w", "-o", str(binary), str(EVALB_C)], check=True)
    report = subprocess.run(
        [binary, "-p", str(EVALB_C.parent / "COLLINS.prm"), "-e", "100000"]
        + [str(workdir / "test_gold.mrg"), str(workdir / "test_trees.mrg")],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    expected = evalb.format_report(evalb.score(gold, predicted))
    assert report == expected
    # EVALB prints "-nan" where no bracket matched (precision and recall 0); results say 0.
    matched = results["test_precision"] + results["test_recall"] > 0
    f1 = f"{results['test_f1']:6.2f}" if matched else "  -nan"
    assert f"Bracketing FMeasure       = {f1}" in report, report

  # tune_decoding chooses beam and α on validation F1 for a parsing run, with and without the
  # tree constraint (--try parsing.tree_constraints=false,true).
  from transformer_jax import tune_decoding

  key = "parsing.tree_constraints"
  assert tune_decoding.parse_try(f"{key}=false,true") == (key, [False, True])
  tuned = tune_decoding.tune(str(workdir), [0.3, 1.0], [1, 2], values=(key, [False, True]))
  assert len(tuned["sweep"]) == 8 and all("valid_f1" in r for r in tuned["sweep"])
  chosen = (tuned[f"best_{key}"], tuned["best_beam_size"], tuned["best_alpha"])
  scores = {(r[key], r["beam_size"], r["alpha"]): r for r in tuned["sweep"]}
  assert scores[chosen]["valid_f1"] == max(r["valid_f1"] for r in tuned["sweep"])
  assert all(r["valid_repaired"] == 0 for r in tuned["sweep"] if r[key])
  assert "test_f1" in tuned and (workdir / "test_trees.tuned.mrg").is_file()
  tuned_trees = evalb.read_lines(str(workdir / "test_trees.tuned.mrg"))
  assert len(tuned_trees) == tuned["test_sentences"] == results["test_sentences"]
  assert evalb.read_lines(str(workdir / "test_trees.mrg")) == predicted  # the run's own, kept

  # The GPU script's parse row (benchmarks/parse.py, here on the CPU): the validation sentences
  # parsed from their words at each width, with the F1 tune_decoding found for the same search.
  bench = tmp_path / "bench"
  env = {
      **os.environ, "ROWS": "parse", "PARSE_RUN": str(workdir), "PARSE_BEAMS": "1,2",
      "PARSE_REPEATS": "1",
  }  # fmt: skip
  done = subprocess.run(
      ["bash", "benchmarks/accelerator.sh", str(bench)],
      cwd=REPO, capture_output=True, text=True, timeout=900, env=env,
  )  # fmt: skip
  assert done.returncode == 0, done.stderr[-3000:]
  [row] = [json.loads(line) for line in (bench / "results.jsonl").read_text().splitlines()]
  assert row["name"] == "parse" and row["rc"] == 0 and row["result"], done.stdout
  result = row["result"]
  valid = pipeline.load_dataset(config, str(workdir)).splits["eval"].pairs
  assert result["sentences"] == len(valid) and result["tree_constraints"] is True
  for beam in (1, 2):
    timed = result[f"beam{beam}"]
    assert timed["warm_sentences_per_s"] > 0 and timed["repaired"] == 0
    assert timed["rows"] >= len(valid) and timed["steps"] > 0
    assert timed["f1"] == round(scores[(True, beam, 0.3)]["valid_f1"], 2), (timed, scores)
  assert done.stdout.startswith("parse: greedy "), done.stdout

  sentences = "Pierre Vinken will join the board .\nProfits rose ( sharply ) .\n"
  proc = _parse(workdir, sentences)
  assert proc.returncode == 0, proc.stderr.decode()[-2000:]
  out = proc.stdout.decode().splitlines()
  assert len(out) == 2 and "sentences;" in proc.stderr.decode()
  words = [scoring.sentence_words(line) for line in sentences.splitlines()]
  assert [trees.parse_trees(line)[0].words() for line in out] == words
  assert all(line.startswith("(TOP ") for line in out)
  # --beam_stop k_finished: the run's beam (2) stops once two hypotheses finished; a tree a line.
  proc = _parse(workdir, sentences, "--beam_stop", "k_finished")
  assert proc.returncode == 0, proc.stderr.decode()[-2000:]
  stopped = proc.stdout.decode().splitlines()
  assert [trees.parse_trees(line)[0].words() for line in stopped] == words

  # The parse command with the constraint: well-formed trees over the input's words, none repaired.
  # Twice, with a compilation cache: the second call compiles nothing and traces nothing.
  cache = tmp_path / "jax_cache"
  outputs = []
  for _ in range(2):
    proc = subprocess.run(
        [sys.executable, "-m", "transformer_jax.parse", "--workdir", str(workdir)]
        + ["--tree_constraints", "--beam_size", "1", f"--compilation_cache={cache}"],
        input=sentences.encode(),
        capture_output=True,
        cwd=REPO,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    assert "; 0 outputs were not well-formed" in proc.stderr.decode()
    out = proc.stdout.decode().splitlines()
    assert [trees.parse_trees(line)[0].words() for line in out] == words
    found = re.search(r"(\d+) compiled; (\d+) read exported, (\d+) exported", proc.stderr.decode())
    assert found, proc.stderr.decode()[-2000:]
    outputs.append((out, *map(int, found.groups())))
  (first, compiled, read, exported), (again, compiled_again, read_again, exported_again) = outputs
  assert compiled > 0 and read == 0 and exported > 0
  assert again == first and compiled_again == 0 and read_again == exported and not exported_again

  # From Python: plain sentences in, nltk.Tree objects out, the same trees the command writes
  # for their Treebank tokens (--tokenize), each over exactly those tokens.
  import nltk

  from transformer_jax.tasks.parsing import parser

  plain = ["Pierre Vinken will join the board.", "Profits rose (sharply) and didn't fall."]
  loaded = parser.Parser.load(str(workdir), tree_constraints=True, beam_size=1)
  parsed = loaded.parse(plain)
  assert all(isinstance(t, nltk.Tree) and t.label() == "TOP" for t in parsed)
  assert [t.leaves() for t in parsed] == [parser.tokenize(s) for s in plain]
  assert loaded.parse([parser.tokenize(s) for s in plain]) == parsed  # tokenized input
  proc = subprocess.run(
      [sys.executable, "-m", "transformer_jax.parse", "--workdir", str(workdir), "--tokenize"]
      + ["--tree_constraints", "--beam_size", "1", f"--compilation_cache={cache}"],
      input="".join(f"{s}\n" for s in plain).encode(),
      capture_output=True,
      cwd=REPO,
      timeout=600,
  )
  assert proc.returncode == 0, proc.stderr.decode()[-2000:]
  assert [nltk.Tree.fromstring(line) for line in proc.stdout.decode().splitlines()] == parsed
  with pytest.raises(errors.UserError, match="sentence 2 is empty"):
    loaded.parse(["Fine.", "   "])


TWO_SENTENCES = "Pierre Vinken will join the board .\nProfits rose ( sharply ) .\n"


def _train_and_parse(config, workdir) -> list[str]:
  """Trains `config` into `workdir` (results.json: no repaired tree, an F1, a validation loss),
  parses TWO_SENTENCES with the parse command and returns its lines, each a tree over exactly
  its sentence's words."""
  import jax

  from transformer_jax.training import train

  results = train.run(config, str(workdir), devices=jax.devices()[:1])
  assert results["test_repaired"] == 0 and 0.0 <= results["test_f1"] <= 100.0
  assert results["eval_nll"] > 0.0
  proc = _parse(workdir, TWO_SENTENCES)
  assert proc.returncode == 0, proc.stderr.decode()[-2000:]
  lines = proc.stdout.decode().splitlines()
  words = [scoring.sentence_words(line) for line in TWO_SENTENCES.splitlines()]
  assert [trees.parse_trees(line)[0].words() for line in lines] == words
  return lines


@pytest.mark.slow
def test_a_span_chart_trains_evaluates_and_parses(shared_data, tmp_path):
  """configs/parsing_sample.py:chart made tiny (its relative positions kept): the task's own model
  (ChartParser, no decoder) and loss (the tree's); the run evaluates with EVALB, its parses read
  back with no repair, and the parse command and `Parser` give the same trees over exactly the
  input's words, whatever beam they are asked for."""
  from transformer_jax.tasks.parsing import chart_model
  from transformer_jax.tasks.parsing.parser import Parser

  config = _tiny_sample_config(shared_data)
  parsing_sample.chart(config)
  assert config.model.relative_positions > 0  # through training, evaluation, saved programs
  config.eval.num_sentences = 8
  workdir = tmp_path / "run"
  lines = _train_and_parse(config, workdir)
  parser = Parser.load(str(workdir))
  assert isinstance(parser.run.model, chart_model.ChartParser)
  assert set(parser.run.params) == {"source_embedding", "encoder", "chart"}
  assert parser.parse_strings(TWO_SENTENCES.splitlines(), beam_size=4) == lines
