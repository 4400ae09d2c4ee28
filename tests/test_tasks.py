"""tasks: the registry, a run's task from its config (today's and the layout before tasks), and
a command refusing another task's run by name."""

import json
import pathlib

import pytest

from configs import multi30k, parsing_sample, quickstart
from transformer_jax import config as config_lib
from transformer_jax import errors, tasks
from transformer_jax.tasks import base

DATA = pathlib.Path(__file__).resolve().parent / "data"


def _workdir(tmp_path, config) -> str:
  (tmp_path / "config.json").write_text(config.to_json_best_effort())
  return str(tmp_path)


def test_each_config_names_its_task_and_its_task_a_command():
  assert tasks.names() == ["parsing", "translation"]
  for get_config, task, command in (
      (multi30k.get_config, "translation", "translate"),
      (quickstart.get_config, "translation", "translate"),
      (parsing_sample.get_config, "parsing", "parse"),
  ):
    config = get_config()
    assert config.task == task and tasks.get(task).name == task
    assert tasks.command_of(task) == command == tasks.get(task).command
    assert config.data.source in tasks.get(task).sources
  with pytest.raises(errors.UserError, match=r"config.task='reversal': expected one of"):
    tasks.get("reversal")


@pytest.mark.parametrize(
    "get_config, command, message",
    [
        (
            multi30k.get_config,
            "parse",
            "is a translation run (data.source='text'), not a parsing run: "
            "use python -m transformer_jax.translate for it",
        ),
        (
            parsing_sample.get_config,
            "translate",
            "is a parsing run (data.source='ptb'), not a translation run: "
            "use python -m transformer_jax.parse for it",
        ),
    ],
)
def test_a_command_refuses_a_run_of_another_task(tmp_path, get_config, command, message):
  workdir = _workdir(tmp_path, get_config())
  with pytest.raises(errors.UserError) as refused:
    tasks.check_command(workdir, command)
  assert str(refused.value) == f"--workdir={workdir} {message}"
  tasks.check_command(workdir, tasks.command_of(get_config().task))  # its own command takes it


def test_a_workdir_without_a_readable_config_is_left_to_the_loader(tmp_path):
  tasks.check_command(str(tmp_path), "translate")  # no config.json: load_run says so
  (tmp_path / "config.json").write_text("{not json")
  tasks.check_command(str(tmp_path), "parse")


def test_a_registered_task_is_chosen_by_name_and_refused_by_the_builtin_commands(tmp_path):
  class Echo(base.Task):
    name, sources = "echo_for_test", ("synthetic",)

  tasks.register(Echo())
  try:
    assert "echo_for_test" in tasks.names() and tasks.command_of("echo_for_test") is None
    config = config_lib.default_config("echo_for_test")
    assert "echo_for_test" not in config  # a task without a section of its own
    config_lib.validate(config)
    workdir = _workdir(tmp_path, config)
    with pytest.raises(errors.UserError, match="is a echo_for_test run .* no command decodes"):
      tasks.check_command(workdir, "translate")
  finally:
    tasks.unregister("echo_for_test")


@pytest.mark.parametrize("kind", ["translation", "parsing"])
def test_a_config_json_written_before_tasks_loads_into_the_sections(kind, tmp_path):
  """config.json of a quickstart run and of a parsing_sample run, as the code before the task
  boundary wrote them (tests/data/): each reads into today's layout, the parsing keys moved
  from data/train/eval into config.parsing, and validates; the commands tell its task."""
  saved = json.loads((DATA / f"config_{kind}_before_tasks.json").read_text())
  assert "task" not in saved
  if kind == "parsing":
    saved["data"]["path"] = str(tmp_path)
    assert saved["data"]["tree_words"] is True and saved["eval"]["tree_constraints"] is True
  config = config_lib.from_saved(saved)
  config_lib.validate(config)
  assert config.task == kind and tasks.saved_task(saved) == kind
  for section, key in tasks.LEGACY_KEYS:
    assert key not in config[section]
  if kind == "parsing":
    assert config.parsing.to_dict() == {
        "tree_closing": "labeled",
        "tree_words": True,
        "tree_order": "in_order",
        "suffix_letters": 2,  # a key added since: its default
        "word_dropout": 0.0,
        "tree_constraints": True,
        "decoder": "sequence",  # keys added since: their defaults
        "chart_hidden": 256,
    }
    assert config.model.d_model == 128 and config.data.packed_source_len == 96
  else:
    assert "parsing" not in config and config.model.d_model == 128
  # Written again by today's code, it reads back the same.
  again = config_lib.from_saved(json.loads(config.to_json_best_effort()))
  assert again.to_dict() == config.to_dict()
  (tmp_path / "config.json").write_text(json.dumps(saved))
  other = {"translation": "parse", "parsing": "translate"}[kind]
  with pytest.raises(errors.UserError, match=f"is a {kind} run"):
    tasks.check_command(str(tmp_path), other)
