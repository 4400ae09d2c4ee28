"""tasks: a run's task from its config, and a command refusing another task's run by name."""

import json

import pytest

from configs import multi30k, parsing_sample
from transformer_jax import errors, tasks


def _workdir(tmp_path, config) -> str:
  (tmp_path / "config.json").write_text(config.to_json_best_effort())
  return str(tmp_path)


def test_each_source_has_its_task_and_command():
  config = multi30k.get_config()
  assert tasks.task_of(config) == "translation"
  assert tasks.task_of(json.loads(parsing_sample.get_config().to_json_best_effort())) == "parsing"
  for source in ("text", "tfds", "synthetic"):
    config.data.source = source
    assert tasks.COMMANDS[tasks.task_of(config)] == "translate"


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
  other = tasks.COMMANDS[tasks.task_of(get_config())]
  tasks.check_command(workdir, other)  # its own command takes it


def test_a_workdir_without_a_readable_config_is_left_to_the_loader(tmp_path):
  tasks.check_command(str(tmp_path), "translate")  # no config.json: load_run says so
  (tmp_path / "config.json").write_text("{not json")
  tasks.check_command(str(tmp_path), "parse")
