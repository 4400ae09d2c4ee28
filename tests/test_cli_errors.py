"""A user's mistake on the command line ends in one line naming it, before any compute.

The checks on the library functions run in this process; the `subprocess` ones start the real
programs (train.py, sweep, plot, benchmarks/throughput.py) and check what the user sees: exit
status 1 and a single stderr line `error: ...` (cli.run), no traceback.
"""

import importlib.util
import io
import os
import pathlib
import re
import subprocess
import sys

import pytest

from transformer_jax import config as config_lib
from transformer_jax import errors, figures, plot, sweep

REPO = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = sorted(p.name for p in (REPO / "configs").glob("*.py") if p.name != "__init__.py")


def _config_module(name: str):
  spec = importlib.util.spec_from_file_location(f"_config_{name[:-3]}", REPO / "configs" / name)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _variants(name: str) -> list[str]:
  """The variants (`--config configs/NAME:VARIANT`) each config file accepts."""
  if name == "table3.py":
    return list(_config_module(name).PAPER)
  variants = {
      "big.py": ["enfr"],
      "quickstart.py": ["smoke"],
      "parsing_sample.py": ["chart"],
      "multi30k.py": ["tiny"],
  }
  return variants.get(name, [])


def test_every_config_file_is_covered():
  assert set(CONFIGS) == {
      "base.py",
      "big.py",
      "multi30k.py",
      "parsing_sample.py",
      "parsing_wsj.py",
      "quickstart.py",
      "table3.py",
  }


@pytest.mark.parametrize("name", CONFIGS)
def test_a_config_builds_without_a_variant_and_with_each_of_its_own(name):
  module = _config_module(name)
  for variant in [None, "", *_variants(name)]:
    config = module.get_config(variant)
    if config.data.source not in ("text", "ptb"):  # their data.path must exist on this machine
      config_lib.validate(config)


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("variant", ["typo", "Smoke", "enfr ", "base:A1"])
def test_a_wrong_variant_is_refused_naming_the_file_and_the_valid_ones(name, variant):
  module = _config_module(name)
  with pytest.raises(config_lib.ConfigError) as raised:
    module.get_config(variant)
  message = str(raised.value)
  assert message.startswith(f"configs/{name}:{variant}: ")
  if _variants(name):
    assert all(v in message for v in _variants(name)), message
  else:
    assert f"{name} takes no variant" in message


def test_a_workdir_that_is_a_file_is_refused_before_anything_is_written(tmp_path):
  from testing import tiny_train_config

  from transformer_jax.training import train

  path = tmp_path / "notes.txt"
  path.write_text("mine\n")
  with pytest.raises(errors.UserError, match=r"notes.txt is a file, not a directory"):
    train.run(tiny_train_config(), str(path))
  assert path.read_text() == "mine\n" and os.listdir(tmp_path) == ["notes.txt"]


def test_plot_refuses_a_directory_that_is_not_a_run_and_an_empty_log(tmp_path):
  with pytest.raises(FileNotFoundError, match="is .* the --workdir of a training run"):
    plot.read_metrics(str(tmp_path))
  (tmp_path / "metrics.jsonl").write_text("\n")
  with pytest.raises(errors.UserError, match=r"metrics.jsonl is empty"):
    plot.read_metrics(str(tmp_path))


@pytest.mark.parametrize("output, expected", [
    ("DIR", "is a directory"),
    ("DIR/missing/curves.png", "the directory .*missing does not exist"),
    ("DIR/curves.xyz", r"expected a name ending in .*\.png"),
    ("DIR/curves", r"expected a name ending in .*\.png"),
])  # fmt: skip
def test_plot_refuses_an_output_it_could_not_write(tmp_path, output, expected):
  with pytest.raises(errors.UserError, match=expected):
    figures.check_output(output.replace("DIR", str(tmp_path)))
  figures.check_output(str(tmp_path / "curves.png"))  # and accepts one it can


def test_sweep_refuses_a_missing_file_and_a_config_that_is_not_a_sweep(tmp_path):
  with pytest.raises(errors.UserError, match="no such sweep config file"):
    sweep.load_sweep(str(tmp_path / "nothing.py"))
  with pytest.raises(errors.UserError, match="not a sweep config, it has no PAPER dict"):
    sweep.load_sweep(str(REPO / "configs" / "base.py"))
  (tmp_path / "empty.py").write_text("PAPER = {}\n")
  with pytest.raises(errors.UserError, match="not a sweep config"):
    sweep.load_sweep(str(tmp_path / "empty.py"))
  with pytest.raises(errors.UserError, match="expected KEY=VALUE"):
    sweep.parse_override("=3")


@pytest.mark.parametrize("text, expected", [
    ("{", r"results.json is not valid JSON \(line 1, column 2: "),
    ('{"step": 3}', r"results.json lacks \['num_params', 'eval_perplexity', 'test_bleu'\]"),
    ("[1, 2]", r"results.json holds a JSON array where a JSON object is expected"),
])  # fmt: skip
def test_sweep_names_a_damaged_results_file(tmp_path, text, expected):
  (tmp_path / "A1").mkdir()
  (tmp_path / "A1" / "results.json").write_text(text)
  with pytest.raises(errors.UserError, match=expected):
    sweep.collect(str(tmp_path), ["A1"], {"A1": ({}, 1.0, 1.0, None)})


@pytest.mark.parametrize("path, expected", [
    ("DIR/a_dir", r"--output DIR/a_dir is a directory; give a file name"),
    ("DIR/missing/out.txt", r"--output DIR/missing/out.txt: the directory DIR/missing does not"),
    ("DIR/a_file/out.txt", r"--output DIR/a_file/out.txt: DIR/a_file is a file, not a directory"),
    ("DIR/a_file/x/out.txt", r"--output DIR/a_file/x: DIR/a_file is a file, not a directory"),
])  # fmt: skip
def test_an_output_file_that_cannot_be_written_is_named(tmp_path, path, expected):
  from transformer_jax import cli

  (tmp_path / "a_file").write_text("x\n")
  (tmp_path / "a_dir").mkdir()
  with pytest.raises(errors.UserError, match=expected.replace("DIR", str(tmp_path))):
    cli.check_output_file(path.replace("DIR", str(tmp_path)))
  cli.check_output_file(str(tmp_path / "a_file"))  # a file to overwrite, or a new one, is fine
  cli.check_output_file(str(tmp_path / "a_dir" / "new.txt"))


@pytest.mark.parametrize("path, expected", [
    ("DIR/a_file", r"--workdir DIR/a_file is a file, not a directory"),
    ("DIR/a_file/run", r"--workdir DIR/a_file/run: DIR/a_file is a file, not a directory"),
    ("DIR/a_file/run/deeper", r"--workdir DIR/a_file/run/deeper: DIR/a_file is a file"),
])  # fmt: skip
def test_a_directory_with_a_file_in_its_way_is_named(tmp_path, path, expected):
  from transformer_jax import cli

  (tmp_path / "a_file").write_text("x\n")
  with pytest.raises(errors.UserError, match=expected.replace("DIR", str(tmp_path))):
    cli.make_directory(path.replace("DIR", str(tmp_path)))
  cli.make_directory(str(tmp_path / "new" / "run"))  # and makes one that can be made
  assert (tmp_path / "new" / "run").is_dir()


@pytest.mark.parametrize("mesh, expected", [
    ({"data": 16}, r"config.mesh=.* needs 16 devices, but 8 are available"),
    ({"data": -1, "tensor": 3}, r"config.mesh=.*: 8 devices do not divide by 3"),
    ({"data": 2, "fsdp": 2, "tensor": 1}, r"config.mesh=.* needs 4 devices, but 8 are available"),
])  # fmt: skip
def test_training_on_a_mesh_larger_than_the_machine_is_refused_before_anything(
    tmp_path, mesh, expected
):
  from testing import tiny_train_config

  from transformer_jax.training import train

  config = tiny_train_config()
  config.mesh.update(mesh)
  with pytest.raises(errors.UserError, match=expected):
    train.run(config, str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()


def test_a_token_budget_too_small_for_the_devices_is_refused_before_any_data(tmp_path):
  from testing import tiny_train_config

  from transformer_jax.training import train

  config = tiny_train_config()  # 512 tokens, rows of 24: 21 rows, not one per device of 32
  config.data.row_multiple = 32
  with pytest.raises(errors.UserError, match=r"data.row_multiple=32 rows of data.max_len=24"):
    train.run(config, str(tmp_path / "run"))
  config.data.row_multiple = 1
  config.data.tokens_per_batch = 100  # 4 rows of 24; 8 devices need 8
  with pytest.raises(errors.UserError, match=r"tokens_per_batch=100: .* need at least 192 tokens"):
    train.run(config, str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()


def test_a_task_whose_section_the_config_lacks_is_named_before_any_check_reads_it():
  from configs import quickstart

  config = quickstart.get_config()
  config.task = "parsing"  # what --config.task=parsing makes of a translation config
  expected = r"^config.task='parsing': this config has no config.parsing section .*\('parsing'\)$"
  with pytest.raises(config_lib.ConfigError, match=expected):
    config_lib.validate(config)


def test_the_line_reader_drops_a_byte_order_mark_opening_the_input():
  """A file saved "UTF-8 with BOM" (Windows editors): the mark would stay in the first word of
  what translate and parse read (cli.read_lines). Only the input's first bytes are a mark."""
  from transformer_jax import cli

  def read(data: bytes) -> list[str]:
    return list(cli.read_lines(io.BytesIO(data), "in.txt"))

  assert read(b"\xef\xbb\xbfA dog barks .\r\nB\n") == ["A dog barks .", "B"]
  assert read("A\n\ufeffB\n".encode()) == ["A", "\ufeffB"]  # inside the text: a character
  assert read(b"\xef\xbb\xbf\n") == [""] and read(b"\xef\xbb\xbf") == [""]
  with pytest.raises(errors.UserError, match="^in.txt line 1 is not valid UTF-8"):
    read(b"\xef\xbb\xbfcaf\xe9\n")


# ------------------------------------------- tune_decoding --try: a decoding key, checked first

TAKES = "--try takes eval.beam_stop, eval.matmul_dtype, eval.max_decode_extra"


def _run_config(workdir: pathlib.Path, task: str = "translation") -> pathlib.Path:
  """`workdir` holding only the config.json of a tiny run of `task`: what the checks read."""
  from testing import tiny_train_config

  if task == "translation":
    config = tiny_train_config()
  else:
    config = config_lib.default_config(task)
    config.data.source, config.data.path = "ptb", str(workdir / "treebank")
  workdir.mkdir(parents=True, exist_ok=True)
  (workdir / "config.json").write_text(config.to_json_best_effort())  # as train.py writes it
  return workdir


@pytest.fixture
def nothing_loaded(monkeypatch):
  """Loading a run's parameters or reading its data fails the test."""
  from transformer_jax.data import pipeline
  from transformer_jax.runs import inference

  def loaded(*args, **kwargs):
    raise AssertionError("a run's parameters or data were loaded")

  for module, name in (
      (inference, "load_run"),
      (inference, "restore_params"),
      (pipeline, "load_dataset"),
      (pipeline, "load_workdir_tokenizer"),
  ):
    monkeypatch.setattr(module, name, loaded)


@pytest.mark.parametrize("task, flag, expected", [
    ("translation", "eval.bogus=1,2", "--try eval.bogus: the run's config has no such key; "),
    ("translation", "bogus=1", "--try bogus: the run's config has no such key; "),
    ("translation", "model.d_model=128,256", "--try model.d_model: not a decoding setting; "),
    ("translation", "train.num_steps=1,2", "--try train.num_steps: not a decoding setting; "),
    ("translation", "eval.batch_size=8,16", "--try eval.batch_size: not a decoding setting; "),
    ("translation", "eval.beam_size=abc", "--try eval.beam_size: beam sizes are tried with "
     "--beam_sizes; "),
    ("translation", "eval.alpha=1", "--try eval.alpha: length penalties are tried with --alphas; "),
    ("translation", "eval.refill=3", "--try eval.refill: it changes how fast the search runs, "
     "not what it writes; "),
    ("translation", "eval.max_decode_extra=abc", "--try eval.max_decode_extra='abc': "
     "eval.max_decode_extra takes int values (the run's is 10); "),
    ("translation", "eval.max_decode_extra=1.5", "--try eval.max_decode_extra='1.5': "
     "eval.max_decode_extra takes int values"),
    ("translation", "eval.beam_stop=bogus", "--try eval.beam_stop='bogus': "
     "config.eval.beam_stop='bogus': must be one of ('proven', 'k_finished'); "),
    ("translation", "eval.max_decode_extra=0", "--try eval.max_decode_extra=0: "
     "config.eval.max_decode_extra=0: must be >= 1; "),
    ("translation", "parsing.tree_constraints=false,true", "--try parsing.tree_constraints: the "
     "run's config has no such key; "),
    ("parsing", "parsing.tree_constraints=3", "--try parsing.tree_constraints='3': "
     "parsing.tree_constraints takes bool values (the run's is False); "),
    ("parsing", "parsing.decoder=chart", "--try parsing.decoder: not a decoding setting; "),
])  # fmt: skip
def test_tune_decoding_refuses_a_try_it_cannot_try_before_loading_anything(
    tmp_path, nothing_loaded, task, flag, expected
):
  from transformer_jax import tune_decoding

  workdir = _run_config(tmp_path / "run", task)
  takes = TAKES + (", parsing.tree_constraints" if task == "parsing" else "")
  with pytest.raises(errors.UserError) as raised:
    tune_decoding.tune(str(workdir), [0.6], values=tune_decoding.split_try(flag))
  message = str(raised.value)
  assert message.startswith(expected) and message.endswith(takes), message
  assert "\n" not in message
  assert sorted(os.listdir(workdir)) == ["config.json"]  # nothing written


def test_tune_decoding_takes_each_value_of_a_decoding_key_as_the_keys_type(tmp_path):
  from transformer_jax import tasks, tune_decoding
  from transformer_jax.runs import inference

  translation = inference.load_config(str(_run_config(tmp_path / "t")))
  parsing = inference.load_config(str(_run_config(tmp_path / "p", "parsing")))

  def check(config, flag):
    return tune_decoding.check_try(config, tasks.get(config.task), *tune_decoding.split_try(flag))

  assert check(translation, "eval.beam_stop=proven,k_finished") == ["proven", "k_finished"]
  assert check(translation, "eval.max_decode_extra=1,50") == [1, 50]  # "1" an int, not True
  assert check(translation, "eval.matmul_dtype=float32,bfloat16") == ["float32", "bfloat16"]
  assert check(parsing, "parsing.tree_constraints=false,1") == [False, True]
  # Python values (the library's callers, parse_try's) are checked as they are.
  key = "parsing.tree_constraints"
  assert tune_decoding.check_try(parsing, tasks.get("parsing"), key, [False, True]) == [
      False,
      True,
  ]
  with pytest.raises(errors.UserError, match=r"takes bool values"):
    tune_decoding.check_try(parsing, tasks.get("parsing"), key, [0, 1])
  with pytest.raises(errors.UserError, match=r"takes str values"):
    tune_decoding.check_try(translation, tasks.get("translation"), "eval.beam_stop", [3])


# ------------------------------------------ a damaged file of a workdir: one line naming it

CONFIG_DAMAGE = {  # case: (the file, what follows "WORKDIR/config.json " in the error)
    "cut short": ('{"model": {', r"is not valid JSON \(line 1, column 12: "),
    "empty": ("", r"is empty: "),
    "a list": ("[1, 2]", r"holds a JSON array where a JSON object is expected: "),
    "a number": ("3", r"holds the JSON value 3 where a JSON object is expected: "),
    "not UTF-8": (b'{"task": "\xe9"}', r"is not UTF-8 text \(byte 0xe9 at offset 10\): "),
    "a section that is no object": ('{"model": 5}', r"does not hold a run's config \(.*\): "),
    "a value of another type": (
        '{"eval": {"beam_size": "x"}}',
        r"does not hold a run's config \(.*'beam_size'.*\): ",
    ),
}


def _damage(path: pathlib.Path, content) -> None:
  if isinstance(content, bytes):
    path.write_bytes(content)
  else:
    path.write_text(content)


@pytest.mark.parametrize("case", list(CONFIG_DAMAGE))
def test_a_damaged_config_json_is_named_by_every_command_that_reads_it(
    tmp_path, nothing_loaded, case
):
  from testing import tiny_train_config

  from transformer_jax import average, tasks, tune_decoding
  from transformer_jax.runs import inference
  from transformer_jax.training import train

  content, expected = CONFIG_DAMAGE[case]
  workdir = tmp_path / "run"
  workdir.mkdir()
  _damage(workdir / "config.json", content)
  expected = "^" + re.escape(str(workdir / "config.json")) + " " + expected
  tasks.check_command(str(workdir), "translate")  # passes it on: loading the run names it
  for read in (
      lambda: inference.load_config(str(workdir)),  # translate, parse, export, plot_attention
      lambda: average.average_workdir(str(workdir), 2),
      lambda: tune_decoding.tune(str(workdir), [0.6], values=("eval.beam_stop", ["proven"])),
      lambda: train.run(tiny_train_config(), str(workdir)),  # a resumed run checks its model
  ):
    with pytest.raises(errors.UserError, match=expected) as raised:
      read()
    assert "\n" not in str(raised.value)
  assert "restore it from a copy or retrain in a new --workdir" in str(raised.value)


def test_a_damaged_results_json_is_named_by_plot(tmp_path):
  (tmp_path / "results.json").write_text('{"test_bleu": 2')
  records = [{"step": 1, "kind": "train", "nll": 2.0}]
  with pytest.raises(errors.UserError, match=r"results.json is not valid JSON \(line 1, column"):
    plot.summary(str(tmp_path), records)
  (tmp_path / "results.json").write_text("[]")
  with pytest.raises(errors.UserError, match=r"results.json holds a JSON array where a JSON obj"):
    plot.summary(str(tmp_path), records)


def test_training_resumes_after_a_record_cut_short_and_plot_reads_the_log(tmp_path):
  from transformer_jax.training import train

  whole = '{"step": 1, "kind": "train", "nll": 2.0}\n'
  (tmp_path / "metrics.jsonl").write_text(whole + '{"step": 2, "kind": "tr')  # killed mid-write
  log = train.MetricLog(str(tmp_path))  # as a resumed run opens it
  log.write(2, "train", {"nll": 1.5})
  log.close()
  assert [r["step"] for r in plot.read_metrics(str(tmp_path))] == [1, 2]
  (tmp_path / "metrics.jsonl").write_text(whole.strip())  # a whole record without its line end
  train.MetricLog(str(tmp_path)).write(2, "train", {"nll": 1.5})
  assert [r["step"] for r in plot.read_metrics(str(tmp_path))] == [1, 2]


@pytest.mark.parametrize("name, content, expected", [
    ("vocab.txt", "<pad>\n</s>\n<s>\n<unk>\nthe\nca", r"vocab.txt does not end with a line end"),
    ("vocab.txt", "", r"vocab.txt is empty: "),
    ("vocab.txt", b"<pad>\n</s>\n<s>\n<unk>\n\xff\n", r"vocab.txt is not UTF-8 text \(byte 0xff"),
    ("vocab.txt", "the\ncat\n", r"vocab.txt: expected the first lines to be"),
    ("vocab.model", b"\x0a\x05cut", r"vocab.model is not a SentencePiece model \(.*\): "),
    ("vocab.model", b"", r"vocab.model is not a SentencePiece model \(.*\): "),
])  # fmt: skip
def test_a_damaged_vocabulary_is_named_before_any_parameters_are_read(
    tmp_path, monkeypatch, name, content, expected
):
  from transformer_jax import average
  from transformer_jax.runs import inference

  monkeypatch.setattr(inference, "restore_params", lambda *a: pytest.fail("parameters read"))
  workdir = _run_config(tmp_path / "run")
  _damage(workdir / name, content)
  for read in (lambda: inference.load_run(str(workdir)), lambda: average.average_workdir(
      str(workdir), 2)):  # fmt: skip
    with pytest.raises(errors.UserError, match="^" + re.escape(str(workdir)) + "/" + expected):
      read()


# ------------------------------------------------------------ the programs, as a user runs them

TRAIN = [sys.executable, "train.py"]
SWEEP = [sys.executable, "-m", "transformer_jax.sweep"]
PLOT = [sys.executable, "-m", "transformer_jax.plot"]
PLOT_ATTENTION = [sys.executable, "-m", "transformer_jax.plot_attention"]
TRANSLATE = [sys.executable, "-m", "transformer_jax.translate"]
PARSE = [sys.executable, "-m", "transformer_jax.parse"]
AVERAGE = [sys.executable, "-m", "transformer_jax.average"]
TUNE = [sys.executable, "-m", "transformer_jax.tune_decoding"]
PREPARE = [sys.executable, "-m", "transformer_jax.prepare_data"]
THROUGHPUT = [sys.executable, "benchmarks/throughput.py"]
QUICKSTART = ["--config", "configs/quickstart.py:smoke"]

# (command, expected start of the one line after "error: "); TMP is the test's tmp_path, which
# holds `a_file`, `not_a_run/` (a directory without metrics.jsonl), `empty_run/` (an empty
# metrics.jsonl), `a_run/` (one record), `sweep/base/results.json` (damaged), `config_only/` (a
# tiny run's config.json alone) and `cut_config/` (a config.json cut short).
CASES = {
    "train: a config without variants given one": (
        [*TRAIN, "--config", "configs/base.py:typo", "--workdir", "TMP/w"],
        "configs/base.py:typo: base.py takes no variant; use configs/base.py",
    ),
    "train: a wrong variant": (
        [*TRAIN, "--config", "configs/big.py:enfrr", "--workdir", "TMP/w"],
        "configs/big.py:enfrr: unknown variant; expected configs/big.py or configs/big.py:enfr",
    ),
    "train: a wrong Table 3 row": (
        [*TRAIN, "--config", "configs/table3.py:F1", "--workdir", "TMP/w"],
        "configs/table3.py:F1: unknown Table 3 row 'F1'; expected one of base, A1, A2",
    ),
    "train: a missing config file": (
        [*TRAIN, "--config", "configs/quickstrat.py", "--workdir", "TMP/w"],
        "--config=configs/quickstrat.py: no such file",
    ),
    "train: an override naming no key": (
        [*TRAIN, *QUICKSTART, "--config.model.num_layer=2", "--workdir", "TMP/w"],
        "a --config.KEY=VALUE flag names no config key: 'num_layer' Did you mean \"num_layers\"",
    ),
    "train: a workdir that is a file": (
        [*TRAIN, *QUICKSTART, "--workdir", "TMP/a_file"],
        "--workdir TMP/a_file is a file, not a directory",
    ),
    "train: a workdir inside a file": (
        [*TRAIN, *QUICKSTART, "--workdir", "TMP/a_file/run"],
        "--workdir TMP/a_file/run: TMP/a_file is a file, not a directory",
    ),
    "train: a mesh larger than the machine": (
        [*TRAIN, *QUICKSTART, "--config.mesh.data=1024", "--workdir", "TMP/w"],
        "config.mesh={'data': 1024, 'fsdp': 1, 'tensor': 1} needs 1024 devices, but 8 are",
    ),
    "train: a mesh that does not divide the machine": (
        [*TRAIN, *QUICKSTART, "--config.mesh.tensor=3", "--workdir", "TMP/w"],
        "config.mesh={'data': -1, 'fsdp': 1, 'tensor': 3}: 8 devices do not divide by 3",
    ),
    "train: a task whose section the config lacks": (
        [*TRAIN, *QUICKSTART, "--config.task=parsing", "--workdir", "TMP/w"],
        "config.task='parsing': this config has no config.parsing section (it was not made for "
        "the parsing task); use a config file of that task, or build the config from "
        "default_config('parsing')",
    ),
    "translate: an output in a missing directory": (
        [*TRANSLATE, "--workdir", "TMP/not_a_run", "--output", "TMP/out/hyp.txt"],
        "--output TMP/out/hyp.txt: the directory TMP/out does not exist",
    ),
    "translate: an output that is a directory": (
        [*TRANSLATE, "--workdir", "TMP/not_a_run", "--output", "TMP/not_a_run"],
        "--output TMP/not_a_run is a directory; give a file name",
    ),
    "translate: an output inside a file": (
        [*TRANSLATE, "--workdir", "TMP/not_a_run", "--output", "TMP/a_file/hyp.txt"],
        "--output TMP/a_file/hyp.txt: TMP/a_file is a file, not a directory",
    ),
    "translate: a missing input": (
        [*TRANSLATE, "--workdir", "TMP/not_a_run", "--input", "TMP/in.txt"],
        "--input=TMP/in.txt: no such file",
    ),
    "translate: a workdir that is a file": (
        [*TRANSLATE, "--workdir", "TMP/a_file"],
        "--workdir TMP/a_file is a file, not a directory",
    ),
    "translate: a missing workdir": (
        [*TRANSLATE, "--workdir", "TMP/nothing"],
        "--workdir TMP/nothing: no such directory",
    ),
    "translate: a directory that is no run": (
        [*TRANSLATE, "--workdir", "TMP/not_a_run"],
        "TMP/not_a_run has no config.json",
    ),
    "parse: an output in a missing directory": (
        [*PARSE, "--workdir", "TMP/not_a_run", "--output", "TMP/out/trees.mrg"],
        "--output TMP/out/trees.mrg: the directory TMP/out does not exist",
    ),
    "average: a workdir that is a file": (
        [*AVERAGE, "--workdir", "TMP/a_file"],
        "--workdir TMP/a_file is a file, not a directory",
    ),
    "average: a directory that is no run": (
        [*AVERAGE, "--workdir", "TMP/not_a_run"],
        "TMP/not_a_run has no config.json",
    ),
    "tune_decoding: a missing workdir": (
        [*TUNE, "--workdir", "TMP/nothing/run"],
        "--workdir TMP/nothing/run: no such directory",
    ),
    "tune_decoding: a --try key that is no decoding setting": (
        [*TUNE, "--workdir", "TMP/config_only", "--try", "model.d_model=128,256"],
        f"--try model.d_model: not a decoding setting; {TAKES}",
    ),
    "tune_decoding: a --try key the config lacks": (
        [*TUNE, "--workdir", "TMP/config_only", "--try", "eval.bogus=1,2"],
        f"--try eval.bogus: the run's config has no such key; {TAKES}",
    ),
    "translate: a config.json cut short": (
        [*TRANSLATE, "--workdir", "TMP/cut_config"],
        "TMP/cut_config/config.json is not valid JSON (line 1, column 12: Expecting property name",
    ),
    "tune_decoding: a wrong list": (
        [*TUNE, "--workdir", "TMP/not_a_run", "--alphas", "0.6,x"],
        "--alphas='0.6,x' is not a comma-separated list of float values",
    ),
    "plot_attention: an output in a missing directory": (
        [*PLOT_ATTENTION, "--workdir", "TMP/not_a_run", "--sentence", "a", "--output",
         "TMP/figures/a.png"],
        "--output TMP/figures/a.png: the directory TMP/figures does not exist",
    ),  # fmt: skip
    "plot_attention: a workdir that is a file": (
        [*PLOT_ATTENTION, "--workdir", "TMP/a_file", "--sentence", "a"],
        "--workdir TMP/a_file is a file, not a directory",
    ),
    "prepare_data: a workdir inside a file": (
        [*PREPARE, "--config", "configs/base.py", "--workdir", "TMP/a_file/run"],
        "--workdir TMP/a_file/run: TMP/a_file is a file, not a directory",
    ),
    "prepare_data: a cache_dir inside a file": (
        [*PREPARE, "--config", "configs/base.py", "--config.data.cache_dir=TMP/a_file/prepared"],
        "config.data.cache_dir TMP/a_file/prepared: TMP/a_file is a file, not a directory",
    ),
    "prepare_data: a missing config file": (
        [*PREPARE, "--config", "configs/bse.py"],
        "--config=configs/bse.py: no such file",
    ),
    "prepare_data: the synthetic source": (
        [*PREPARE, "--config", "configs/quickstart.py"],
        "config.data.source='synthetic' is generated in memory",
    ),
    "sweep: a missing config file": (
        [*SWEEP, "--config", "configs/tabel3.py", "--workdir_root", "TMP/w"],
        "--config=configs/tabel3.py: no such sweep config file",
    ),
    "sweep: a config that is not a sweep": (
        [*SWEEP, "--config", "configs/base.py", "--workdir_root", "TMP/w"],
        "--config=configs/base.py: not a sweep config",
    ),
    "sweep: a wrong row": (
        [*SWEEP, "--rows", "A1,A9", "--workdir_root", "TMP/w"],
        "--rows: configs/table3.py has no rows ['A9']",
    ),
    "sweep: a workdir_root that is a file": (
        [*SWEEP, "--workdir_root", "TMP/a_file", "--dry_run"],
        "--workdir_root TMP/a_file is a file, not a directory",
    ),
    "sweep: --table_only on nothing": (
        [*SWEEP, "--workdir_root", "TMP/w", "--table_only"],
        "--workdir_root TMP/w: no such directory",
    ),
    "sweep: a damaged results.json": (
        [*SWEEP, "--workdir_root", "TMP/sweep", "--table_only"],
        "TMP/sweep/base/results.json is not valid JSON",
    ),
    "plot: a directory that is no run": (
        [*PLOT, "--workdir", "TMP/not_a_run"],
        "--workdir: TMP/not_a_run/metrics.jsonl does not exist",
    ),
    "plot: a run that logged nothing": (
        [*PLOT, "--workdir", "TMP/empty_run"],
        "TMP/empty_run/metrics.jsonl is empty",
    ),
    "plot: an output in a missing directory": (
        [*PLOT, "--workdir", "TMP/a_run", "--output", "TMP/figures/curves.png"],
        "--output TMP/figures/curves.png: the directory TMP/figures does not exist",
    ),
    "throughput: a wrong variant": (
        [*THROUGHPUT, "--config", "configs/quickstart.py:tiny"],
        "configs/quickstart.py:tiny: unknown variant",
    ),
    "throughput: --batch_size alone": (
        [*THROUGHPUT, "--config", "configs/quickstart.py", "--batch_size=8"],
        "--batch_size=8 --seq_len=0: give both",
    ),
    "throughput: --seq_len beyond the model": (
        [*THROUGHPUT, "--config", "configs/quickstart.py", "--batch_size=8", "--seq_len=65"],
        "--seq_len=65 exceeds config.model.max_len=64",
    ),
}


@pytest.fixture
def user_files(tmp_path):
  (tmp_path / "a_file").write_text("not a directory\n")
  (tmp_path / "not_a_run").mkdir()
  (tmp_path / "empty_run").mkdir()
  (tmp_path / "empty_run" / "metrics.jsonl").write_text("")
  (tmp_path / "a_run").mkdir()
  (tmp_path / "a_run" / "metrics.jsonl").write_text('{"step": 1, "kind": "train", "nll": 2.0}\n')
  (tmp_path / "sweep" / "base").mkdir(parents=True)
  (tmp_path / "sweep" / "base" / "results.json").write_text('{"step": 4, "num_par')
  _run_config(tmp_path / "config_only")
  (tmp_path / "cut_config").mkdir()
  (tmp_path / "cut_config" / "config.json").write_text('{"model": {')
  return tmp_path


@pytest.mark.subprocess
@pytest.mark.parametrize("case", list(CASES))
def test_the_program_ends_with_one_line_naming_the_mistake(case, user_files):
  command, expected = CASES[case]
  command = [arg.replace("TMP", str(user_files)) for arg in command]
  before = sorted(p.relative_to(user_files) for p in user_files.rglob("*"))
  env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
  proc = subprocess.run(
      command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120
  )  # fmt: skip
  lines = proc.stderr.strip().splitlines()
  assert proc.returncode == 1 and len(lines) == 1, proc.stderr[-3000:]
  assert lines[0].startswith("error: " + expected.replace("TMP", str(user_files))), lines[0]
  assert sorted(p.relative_to(user_files) for p in user_files.rglob("*")) == before  # nothing made
