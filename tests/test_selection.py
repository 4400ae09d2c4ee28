"""train.select_on_validation and train.patience: the parameters evaluated at the end are the best
average found on validation, so a longer run (or the same run resumed with more updates) can only
add candidates; patience stops a run whose averages stopped improving; test sets never choose."""

import json

import jax
import pytest
from testing import tiny_train_config

from transformer_jax import config as config_lib
from transformer_jax import tasks
from transformer_jax.runs import checkpoint, inference
from transformer_jax.training import train

TRANSLATION = tasks.get("translation")


def _config(num_steps, **train):
  config = tiny_train_config()
  config.train.update(
      num_steps=num_steps, checkpoint_every=2, eval_every=4, keep_checkpoints=3, average_last=2,
      select_on_validation=True, log_every=2, **train,
  )  # fmt: skip
  config.eval.update(beam_size=1, num_sentences=8)  # periodic evaluations: 8 of the 16
  return config


def _records(workdir, kind):
  with open(workdir / "metrics.jsonl") as f:
    return [r for r in map(json.loads, f) if r.get("kind") == kind]


@pytest.fixture
def scripted_scores(monkeypatch):
  """The validation BLEU of each candidate, played from a list (then 0): which candidate wins is
  the test's to say. The sizes of the splits candidates are scored on are recorded."""
  played, splits = [], []

  def scores(config, hypotheses, pairs):
    if len(pairs) == config.eval.num_sentences:  # a periodic evaluation's subset
      return {"bleu": 0.0}
    splits.append(len(pairs))
    return {"bleu": played.pop(0) if played else 0.0}

  monkeypatch.setattr(TRANSLATION, "scores", scores)
  return played, splits


@pytest.mark.slow  # ~20 s on 2 cores: .ci/run runs it after the default suite
def test_the_best_average_on_validation_is_evaluated_and_more_updates_only_add_candidates(
    tmp_path, scripted_scores
):
  played, splits = scripted_scores
  played.extend([10.0, 30.0, 20.0, 25.0, 40.0, 35.0])  # steps 4, 8, 12 | 16, 20, 24
  results = train.run(_config(12), str(tmp_path), devices=jax.devices()[:1])
  assert results["selected_at_step"] == 8 and results["selected_valid_bleu"] == 30.0
  assert results["selected_steps"] == [6, 8]  # the mean of the last 2 checkpoints at step 8
  assert results["parameters"].startswith("average of steps [6, 8], chosen on validation")
  assert set(splits) == {16}  # the whole validation split, every time; never the test split
  record = checkpoint.averaged_record(str(tmp_path))
  assert record["steps"] == [6, 8] and record["selection"]["score"] == 30.0
  assert inference.resolve_checkpoint(str(tmp_path), "auto", 2) == ("avg", None)
  selects = _records(tmp_path, "select")
  assert [r["step"] for r in selects] == [4, 8, 12]
  assert [r["best_valid_bleu"] for r in selects] == [10.0, 30.0, 30.0]
  # Twice the updates: the same run resumed with num_steps 24 keeps its choice until a better
  # average comes, and then takes it: more updates never choose a worse one on validation.
  more = train.run(_config(24), str(tmp_path), devices=jax.devices()[:1])
  assert more["step"] == 24 and more["selected_at_step"] == 20
  assert more["selected_valid_bleu"] == 40.0 >= results["selected_valid_bleu"]
  assert checkpoint.averaged_record(str(tmp_path))["steps"] == [18, 20]


@pytest.mark.slow  # ~10 s on 2 cores: .ci/run runs it after the default suite
def test_patience_stops_a_run_whose_averages_stopped_improving(tmp_path, scripted_scores):
  played, _ = scripted_scores
  played.extend([5.0, 4.0, 3.0, 2.0])  # the first average stays the best
  results = train.run(_config(40, patience=2), str(tmp_path), devices=jax.devices()[:1])
  assert results["stopped_by"] == "train.patience" and results["step"] == 12
  assert results["selected_at_step"] == 4
  # Resumed with the same config, it does not train again.
  again = train.run(_config(40, patience=2), str(tmp_path), devices=jax.devices()[:1])
  assert again["step"] == 12 and again["stopped_by"] == "train.patience"


@pytest.mark.parametrize(
    "changes,message",
    [
        (dict(eval_every=0), r"train.select_on_validation.*multiple of"),
        (dict(eval_every=3), r"train.select_on_validation.*multiple of"),
        (dict(select_on_validation=False, patience=2), "train.patience"),
        (dict(patience=-1), "train.patience"),
    ],
)
def test_selection_settings_are_checked_before_anything_runs(changes, message):
  config = _config(12)
  config.train.update(**changes)
  with pytest.raises(config_lib.ConfigError, match=message):
    config_lib.validate(config)
