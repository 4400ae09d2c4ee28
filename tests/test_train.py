"""The training loop: learning, sharding invariance, gradient accumulation, exact resume,
preemption (SIGTERM), CLI."""

import dataclasses
import functools
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
import sacrebleu
from testing import tiny_train_config

from transformer_jax import config as config_lib
from transformer_jax import errors, tasks
from transformer_jax.data import batching, pipeline
from transformer_jax.runs import checkpoint
from transformer_jax.training import train

TRANSLATION = tasks.get("translation")

REPO = pathlib.Path(__file__).resolve().parents[1]


def tiny_config(**train_overrides):
  config = tiny_train_config()
  for key, value in train_overrides.items():
    config.train[key] = value
  return config


def make_trainer(config, devices=None):
  dataset = pipeline.load_dataset(config)
  model_config = config_lib.model_config(config, dataset.tokenizer.vocab_size)
  return train.Trainer(config, model_config, devices=devices), dataset


def fixed_batch(dataset, config, rows=16):
  """One batch of `rows` sentences (a multiple of 8, so it splits over 8 devices)."""
  it = batching.BatchIterator(
      dataset.splits["train"].examples,
      seed=0,
      bucket_lengths=dataset.bucket_lengths(config.data),
      batch_size=rows,
  )
  return next(it)


def params_close(a, b, rtol=1e-5, atol=1e-6):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


@pytest.mark.slow  # 10-60 s on 2 cores: .ci/run runs it after the default suite
def test_tiny_model_overfits_one_batch():
  config = tiny_config(lr_multiplier=2.0, warmup_steps=200)
  config.model.dropout_rate = 0.0
  config.train.label_smoothing = 0.0
  trainer, dataset = make_trainer(config, devices=jax.devices()[:1])
  batch = fixed_batch(dataset, config, rows=8)
  state = trainer.init_state(0)
  rng = jax.random.PRNGKey(0)
  first = None
  for _ in range(200):
    state, metrics = trainer.train_step(state, batch, rng)
    if first is None:
      first = train.summarize(jax.device_get(metrics))["nll"]
  last = train.summarize(jax.device_get(metrics))
  assert first > 2.0
  assert last["nll"] < 0.02, last
  assert last["accuracy"] == 1.0


@pytest.mark.slow  # 10-60 s on 2 cores: .ci/run runs it after the default suite
def test_step_on_8_devices_equals_single_device():
  # Dropout on: the masks must not depend on the sharding either. A large Adam ε makes the
  # update proportional to the gradient (instead of ~lr·sign(g)), so comparing weights compares
  # gradients and float32 reduction-order noise is not amplified into lr-sized differences.
  config = tiny_config(adam_eps=1.0, lr_multiplier=100.0)
  single, dataset = make_trainer(config, devices=jax.devices()[:1])
  multi, _ = make_trainer(config)
  assert multi.num_batch_shards == 8
  batch = fixed_batch(dataset, config, rows=16)
  rng = jax.random.PRNGKey(3)
  s1, s8 = single.init_state(0), multi.init_state(0)
  params_close(s1.params, s8.params, rtol=0, atol=0)
  for _ in range(2):
    s1, m1 = single.train_step(s1, batch, rng)
    s8, m8 = multi.train_step(s8, batch, rng)
    np.testing.assert_allclose(m1["loss_sum"], m8["loss_sum"], rtol=1e-5)
    np.testing.assert_allclose(m1["grad_norm"], m8["grad_norm"], rtol=1e-5)
  params_close(s1.params, s8.params)
  # The 8-device state really is laid out over the mesh (the batch axis is split 8 ways).
  assert len(s8.params["shared_embedding"]["embedding"].sharding.device_set) == 8


@pytest.mark.slow  # 10-60 s on 2 cores: .ci/run runs it after the default suite
def test_gradient_accumulation_equals_one_large_batch():
  # No dropout: accumulation draws dropout per micro-batch. Large ε: see the test above.
  config = tiny_config(adam_eps=1.0, lr_multiplier=100.0)
  config.model.dropout_rate = 0.0
  whole, dataset = make_trainer(config, devices=jax.devices()[:2])
  config_accum = tiny_config(grad_accum_steps=4, adam_eps=1.0, lr_multiplier=100.0)
  config_accum.model.dropout_rate = 0.0
  accum, _ = make_trainer(config_accum, devices=jax.devices()[:2])
  batch = fixed_batch(dataset, config, rows=16)
  rng = jax.random.PRNGKey(0)
  sa, sb = whole.init_state(0), accum.init_state(0)
  for _ in range(2):
    sa, ma = whole.train_step(sa, batch, rng)
    sb, mb = accum.train_step(sb, batch, rng)
    for key in ("loss_sum", "weight_sum", "correct_sum"):
      np.testing.assert_allclose(ma[key], mb[key], rtol=1e-5)
  params_close(sa.params, sb.params)


def _final_params(workdir):
  trainer, _ = make_trainer(tiny_config(), devices=jax.devices()[:1])
  manager = checkpoint.make_manager(str(workdir), keep=5, save_every=1)
  state, data_state = checkpoint.restore(manager, trainer.abstract_state())
  manager.close()
  return state, data_state


def _records(workdir, kind):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [r for r in map(json.loads, f) if r["kind"] == kind]


def _train_losses(workdir):
  return {r["step"]: r["loss"] for r in _records(workdir, "train")}


def _on_step(n, action):
  """A Trainer.train_step that runs `action()` when called for the n-th time, then steps."""
  original_step = train.Trainer.train_step
  calls = {"n": 0}

  def train_step(self, state, batch, rng):
    calls["n"] += 1
    if calls["n"] == n:
      action()
    return original_step(self, state, batch, rng)

  return train_step


def _assert_same_final_state(workdir_a, workdir_b):
  """Bit-identical parameters and optimizer state, and the input pipeline at the same place."""
  state_a, data_a = _final_params(workdir_a)
  state_b, data_b = _final_params(workdir_b)
  # Beside the pipeline's position, each checkpoint records the run's training time so far.
  assert data_a.pop("train_seconds") > 0 and data_b.pop("train_seconds") > 0
  assert data_a == data_b
  params_close(state_a.params, state_b.params, rtol=0, atol=0)
  params_close(state_a.opt_state, state_b.opt_state, rtol=0, atol=0)


@pytest.mark.slow  # 10-60 s on 2 cores: .ci/run runs it after the default suite
def test_interrupted_run_resumes_exactly(tmp_path, monkeypatch):
  config = tiny_config(num_steps=6, checkpoint_every=2, log_every=1)
  run = functools.partial(train.run, config, devices=jax.devices()[:1])
  run(str(tmp_path / "straight"))

  def preempt():  # during step 5, after the checkpoint at step 4 completed
    raise KeyboardInterrupt("simulated preemption")

  monkeypatch.setattr(train.Trainer, "train_step", _on_step(5, preempt))
  with pytest.raises(KeyboardInterrupt):
    run(str(tmp_path / "resumed"))
  monkeypatch.undo()
  results = run(str(tmp_path / "resumed"))  # resumes from step 4

  assert results["step"] == 6
  _assert_same_final_state(tmp_path / "straight", tmp_path / "resumed")
  # Steps 5 and 6 saw the same batches: identical losses.
  straight, resumed = _train_losses(tmp_path / "straight"), _train_losses(tmp_path / "resumed")
  assert straight[5] == resumed[5] and straight[6] == resumed[6]


@pytest.mark.slow  # several whole runs (~20 s): run by .ci/run after the default suite
def test_a_run_started_on_one_device_grows_to_eight_at_the_same_data_position(
    tmp_path, monkeypatch
):
  # Rows of 21 (512 tokens // 24) do not split over 8 devices; data.row_multiple=8 makes them 16.
  config = tiny_config(num_steps=4, checkpoint_every=2, log_every=1)
  config.data.row_multiple = 8
  train.run(config, str(tmp_path / "straight"), devices=jax.devices()[:1])

  def stop():  # during step 3, after the checkpoint at step 2
    raise KeyboardInterrupt("the machine is replaced by a bigger one")

  monkeypatch.setattr(train.Trainer, "train_step", _on_step(3, stop))
  with pytest.raises(KeyboardInterrupt):
    train.run(config, str(tmp_path / "grown"), devices=jax.devices()[:1])
  monkeypatch.undo()
  results = train.run(config, str(tmp_path / "grown"), devices=jax.devices()[:8])

  assert results["step"] == 4
  (straight, data_straight), (grown, data_grown) = map(
      _final_params, (tmp_path / "straight", tmp_path / "grown")
  )
  for data in (data_straight, data_grown):
    data.pop("train_seconds")
  assert data_grown == data_straight and data_grown["rows"] == [16]  # the same batches
  params_close(grown.params, straight.params, rtol=1e-4, atol=1e-6)  # 8-way sums: rounding only
  losses = _train_losses(tmp_path / "straight"), _train_losses(tmp_path / "grown")
  assert round(losses[0][4], 4) == round(losses[1][4], 4)

  # A device count that does not divide the saved rows (16 on 3 devices) is one line naming the
  # key that would have allowed it, before any step.
  config.data.row_multiple, config.train.num_steps = 1, 6
  with pytest.raises(
      errors.UserError,
      match=r"cannot resume at step 4: .* \[16\]; .*" r"--config.data.row_multiple",
  ) as raised:
    train.run(config, str(tmp_path / "grown"), devices=jax.devices()[:3])
  assert "\n" not in str(raised.value)
  assert len(_records(tmp_path / "grown", "start")) == 2  # no session of its own


def _garble(path):
  path.write_bytes(b"not a chunk")


def _flip_middle_byte(path):
  """Silent damage: TensorStore reads the chunk as other numbers; only the digest can tell."""
  data = bytearray(path.read_bytes())
  data[len(data) // 2] ^= 0x5A
  path.write_bytes(bytes(data))


@pytest.mark.slow  # several whole runs (~20 s): run by .ci/run after the default suite
@pytest.mark.parametrize(
    "damage", [_garble, _flip_middle_byte], ids=["unreadable", "bytes flipped"]
)
def test_an_unreadable_checkpoint_is_set_aside_and_the_run_resumes_from_the_one_before(
    tmp_path, monkeypatch, caplog, damage
):
  config = tiny_config(num_steps=6, checkpoint_every=2, log_every=1)
  run = functools.partial(train.run, config, devices=jax.devices()[:1])
  run(str(tmp_path / "straight"))

  def preempt():  # during step 5: checkpoints 2 and 4 are complete
    raise KeyboardInterrupt("simulated preemption")

  workdir = tmp_path / "damaged"
  monkeypatch.setattr(train.Trainer, "train_step", _on_step(5, preempt))
  with pytest.raises(KeyboardInterrupt):
    run(str(workdir))
  monkeypatch.undo()
  # Step 4's save was asynchronous: its directory appears (renamed from a temporary one) once
  # the checkpoint is complete. Then its array bytes are damaged.
  deadline = time.monotonic() + 120
  while not (workdir / "checkpoints" / "4").is_dir():
    assert time.monotonic() < deadline, "the checkpoint of step 4 never completed"
    time.sleep(0.1)
  state_dir = workdir / "checkpoints" / "4" / "state"
  # The array data files (ocdbt.process_*/d/), not the b-tree files, which have a CRC.
  damaged = [f for f in state_dir.rglob("*") if f.parent.name == "d" and "process" in str(f)]
  assert damaged
  for f in damaged:
    damage(f)

  results = run(str(workdir))  # resumes from step 2, redoes steps 3-6
  assert results["step"] == 6
  assert (workdir / "checkpoints.unreadable" / "4" / "state").is_dir()  # kept, not deleted
  assert "checkpoint step 4" in caplog.text and "moved to" in caplog.text
  if damage is _flip_middle_byte:
    assert "is damaged" in caplog.text  # found by the digest, not by Orbax
  _assert_same_final_state(tmp_path / "straight", workdir)
  assert _train_losses(tmp_path / "straight")[3] == _train_losses(workdir)[3]

  # When no checkpoint can be restored, the error lists each and nothing is moved.
  steps = sorted(p.name for p in (workdir / "checkpoints").iterdir())
  for f in (workdir / "checkpoints").rglob("*"):
    if f.parent.name == "d":
      f.write_bytes(b"not a chunk")
  with pytest.raises(checkpoint.CheckpointError, match=r"none of the \d+ checkpoints") as e:
    run(str(workdir))
  assert all(f"checkpoint step {s} in" in str(e.value) for s in steps if s.isdigit())
  assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == steps


class _FakeClock:

  def __init__(self):
    self.now = 1000.0

  def __call__(self):
    return self.now


def test_chrono_budget_is_the_runs_training_time(monkeypatch):
  clock = _FakeClock()
  monkeypatch.setattr(train.time, "perf_counter", clock)
  chrono = train.Chrono(budget_minutes=1.0)
  data_state = {"train_seconds": 50.0, "position": 3}
  chrono.load(data_state)
  assert data_state == {"position": 3}  # the pipeline's state is left to the pipeline
  chrono.start_session()
  clock.now += 9.9
  assert chrono.train_seconds == pytest.approx(59.9) and not chrono.budget_spent()
  clock.now += 0.1
  assert chrono.budget_spent()  # earlier sessions' 50 s + this one's 10 s
  assert not chrono.budget_spent(before_session=True)  # the earlier sessions' 50 s alone
  assert chrono.state() == {"train_seconds": pytest.approx(60.0)}
  assert chrono.session_seconds == pytest.approx(10.0)
  unlimited = train.Chrono(budget_minutes=0.0)  # 0 = no budget
  unlimited.prior_seconds = 1e9
  assert not unlimited.budget_spent()


def test_chrono_leaves_pauses_out_of_throughput_not_out_of_the_budget(monkeypatch):
  clock = _FakeClock()
  monkeypatch.setattr(train.time, "perf_counter", clock)
  chrono = train.Chrono()
  for _ in range(4):  # 4 steps of 0.5 s
    clock.now += 0.5
    chrono.tick()
  with chrono.paused():  # an evaluation of 10 s
    clock.now += 10.0
  assert chrono.throughput(tokens=200.0) == {
      "target_tokens_per_s": pytest.approx(100.0),
      "steps_per_s": pytest.approx(2.0),
  }
  assert chrono.train_seconds == pytest.approx(12.0)
  clock.now += 1.0  # the next interval starts after the report: 1 step in 1 s
  chrono.tick()
  assert chrono.throughput(tokens=5.0)["steps_per_s"] == pytest.approx(1.0)


def test_itstime():
  assert [s for s in range(1, 11) if train.itstime(s, 4)] == [4, 8]
  assert [s for s in range(1, 11) if train.itstime(s, 4, last_step=10)] == [4, 8, 10]
  assert not any(train.itstime(s, 0) for s in range(1, 11))  # 0 = never


@pytest.mark.slow  # several whole runs (~20 s): run by .ci/run after the default suite
def test_time_budget_is_the_runs_across_sessions(tmp_path):
  # A budget this small is spent at the first check (every log_every = 2 steps).
  config = tiny_config(num_steps=6, checkpoint_every=100, log_every=2, max_train_minutes=1e-9)
  workdir = str(tmp_path)
  first = train.run(config, workdir, devices=jax.devices()[:1])
  assert first["step"] == 2 and first["stopped_by"] == "train.max_train_minutes"
  state, data_state = _final_params(workdir)
  assert state.step == 2  # checkpointed where it stopped, off the interval
  recorded = data_state["train_seconds"]
  assert 0 < recorded <= first["train_seconds"] == first["train_seconds_this_session"]

  # The budget is the run's, not the session's: the rerun trains nothing and re-evaluates.
  again = train.run(config, workdir, devices=jax.devices()[:1])
  assert again["step"] == 2 and again["stopped_by"] == "train.max_train_minutes"
  assert again["train_seconds"] >= round(recorded, 1)  # results.json rounds to 0.1 s
  assert sorted(_train_losses(workdir)) == [2]

  config.train.max_train_minutes = 60.0  # a larger budget extends it, counting on from there
  results = train.run(config, workdir, devices=jax.devices()[:1])
  assert results["step"] == 6 and results["stopped_by"] == "train.num_steps"
  assert results["train_seconds"] == pytest.approx(
      recorded + results["train_seconds_this_session"], abs=0.2
  )
  # The session that trained nothing saved no checkpoint: the third starts from the first's.
  before = [s["train_seconds_before"] for s in _records(workdir, "start")]
  assert before == [0.0, round(recorded, 1), round(recorded, 1)]
  assert sorted(_train_losses(workdir)) == [2, 4, 6]


@pytest.mark.slow  # several whole runs (~20 s): run by .ci/run after the default suite
def test_a_run_stopped_before_enough_checkpoints_evaluates_its_latest_parameters(tmp_path):
  # §6.1 averaging wants 3 checkpoints; a budget spent at step 2 leaves fewer (steps 1 and 2).
  config = tiny_config(
      num_steps=6,
      checkpoint_every=100,
      log_every=2,
      max_train_minutes=1e-9,
      keep_checkpoints=3,
      average_last=3,
  )
  workdir = str(tmp_path)
  results = train.run(config, workdir, devices=jax.devices()[:1])
  assert results["step"] == 2 and results["stopped_by"] == "train.max_train_minutes"
  assert results["parameters"] == "step 2 (not averaged: 2 checkpoints < train.average_last=3)"
  assert not os.path.exists(os.path.join(workdir, "averaged"))
  # Trained on to the end, the same run averages its last 3 (steps 2, 4, 6: checkpoint_every=2).
  config.train.max_train_minutes = 0.0
  config.train.checkpoint_every = 2
  results = train.run(config, workdir, devices=jax.devices()[:1])
  assert results["parameters"] == "average of steps [2, 4, 6]"


@pytest.mark.slow  # a training run: .ci/run runs it after the default suite
def test_final_evaluation_reports_the_training_pairs_loss_with_dropout_off(tmp_path):
  config = tiny_config()
  trainer, dataset = make_trainer(config, devices=jax.devices()[:1])
  params = trainer.init_state(0).params
  buckets = dataset.eval_bucket_lengths(config.data)
  # With validation as the training split, the two losses are one measurement.
  same = dataclasses.replace(dataset, splits={**dataset.splits, "train": dataset.splits["eval"]})
  results = train.final_evaluation(trainer, params, same, buckets, str(tmp_path))
  assert results["train_subset_sentences"] == len(dataset.splits["eval"].examples)
  assert results["train_subset_nll"] == pytest.approx(results["eval_nll"], rel=1e-6)
  # The real training pairs: the first as many as validation has, scored like validation.
  results = train.final_evaluation(trainer, params, dataset, buckets, str(tmp_path))
  probe = dataset.splits["train"].examples[: results["train_subset_sentences"]]
  expected = trainer.evaluate_loss(params, probe, buckets)
  assert results["train_subset_nll"] == pytest.approx(expected["nll"], rel=1e-6)
  assert results["train_subset_perplexity"] == pytest.approx(np.exp(expected["nll"]), rel=1e-5)


@pytest.mark.slow  # 10-60 s on 2 cores: .ci/run runs it after the default suite
def test_sigterm_checkpoints_the_next_step_and_the_rerun_resumes_exactly(tmp_path, monkeypatch):
  config = tiny_config(num_steps=6, checkpoint_every=100, log_every=1)
  run = functools.partial(train.run, config, devices=jax.devices()[:1])
  run(str(tmp_path / "straight"))

  handler_before = signal.getsignal(signal.SIGTERM)
  # A scheduler's preemption notice, during step 3.
  sigterm = functools.partial(os.kill, os.getpid(), signal.SIGTERM)
  monkeypatch.setattr(train.Trainer, "train_step", _on_step(3, sigterm))
  workdir = tmp_path / "preempted"
  results = run(str(workdir))
  assert results["step"] == 3 and results["stopped_by"] == "preemption"
  assert signal.getsignal(signal.SIGTERM) is handler_before  # the run's handler is removed
  assert not (workdir / "results.json").exists()  # no final evaluation in the grace period
  assert _final_params(workdir)[0].step == 3  # saved off the checkpoint_every interval
  lines = (workdir / "metrics.jsonl").read_text().splitlines()
  kinds = [json.loads(line)["kind"] for line in lines]
  assert kinds[-1] == "preempted"

  monkeypatch.undo()
  results = run(str(workdir))
  assert results["step"] == 6 and results["stopped_by"] == "train.num_steps"
  _assert_same_final_state(tmp_path / "straight", workdir)


def test_resume_with_a_different_model_is_refused(tmp_path):
  config = tiny_config(num_steps=1)
  workdir = str(tmp_path)
  train._check_workdir_config(
      workdir, config, TRANSLATION
  )  # what run() does first: writes config.json
  config.train.num_steps = 10  # a longer schedule for the same model is fine
  train._check_workdir_config(workdir, config, TRANSLATION)
  config.model.d_model = 64
  with pytest.raises(config_lib.ConfigError, match="d_model"):
    train.run(config, workdir, devices=jax.devices()[:1])


@pytest.mark.parametrize(
    "key,value,expected",
    [
        ("model.d_model", 30, "divisible by num_heads"),
        ("model.positional", "rotary", "positional"),
        ("data.source", "web", "data.source"),
        ("data.tokens_per_batch", 8, "data.tokens_per_batch"),
        ("train.warmup_steps", 0, "train.warmup_steps"),
        ("train.cooldown_steps", 10**9, "train.cooldown_steps"),
        ("mesh.data", 0, "mesh.data"),
        ("train.label_smoothing", 1.0, "train.label_smoothing"),
        ("model.key_dim", -4, "key_dim=-4"),
        ("model.relative_positions", -2, "relative_positions=-2"),
        ("model.positional", "none", "positional='none'; expected 'sinusoidal' or 'learned'"),
    ],
)
def test_bad_config_values_fail_naming_the_key(key, value, expected):
  config = tiny_config()
  section, leaf = key.split(".")
  config[section][leaf] = value
  with pytest.raises(config_lib.ConfigError, match=expected):
    config_lib.validate(config)


def test_a_model_key_the_model_lacks_fails_naming_it():
  config = tiny_config()
  config.model.unlock()
  config.model.num_layerz = 2
  with pytest.raises(config_lib.ConfigError, match=r"config\.model\.num_layerz"):
    config_lib.validate(config)
  del config.model["num_layerz"]
  config.model.vocab_size = 8  # the run's data's, not a key to set
  with pytest.raises(config_lib.ConfigError, match=r"config\.model\.vocab_size.*data"):
    config_lib.validate(config)


def test_a_saved_config_loads_on_todays_defaults_and_its_run_resumes(tmp_path):
  config = tiny_config()
  config.train.label_smoothing = 0.2
  saved = json.loads(config.to_json_best_effort())
  del saved["train"]["cooldown_steps"]  # a key the run did not save: its default
  loaded = config_lib.from_saved(saved)
  assert loaded.train.label_smoothing == 0.2
  assert loaded.train.cooldown_steps == config_lib.default_config().train.cooldown_steps
  assert loaded.to_dict() == config.to_dict()
  config_lib.validate(loaded)
  (tmp_path / "config.json").write_text(json.dumps(saved))
  train._check_workdir_config(str(tmp_path), config, TRANSLATION)  # the same model: resumes
  config.model.key_dim = 4
  with pytest.raises(config_lib.ConfigError, match="key_dim"):
    train._check_workdir_config(str(tmp_path), config, TRANSLATION)


def _train_py(workdir, *overrides):
  return subprocess.run(
      [sys.executable, "train.py", "--config", "configs/quickstart.py:smoke", "--workdir", workdir]
      + list(overrides),
      cwd=REPO,
      capture_output=True,
      text=True,
      timeout=600,
  )


@pytest.mark.subprocess
def test_unknown_config_key_fails_before_any_work(tmp_path):
  proc = _train_py(str(tmp_path / "w"), "--config.model.num_layerz=2")
  assert proc.returncode != 0
  assert "num_layerz" in proc.stderr
  assert not (tmp_path / "w").exists()


@pytest.mark.subprocess
def test_train_py_exits_143_on_sigterm_with_a_checkpoint(tmp_path):
  workdir = tmp_path / "w"
  overrides = ["--config.train.num_steps=100000", "--config.train.log_every=1"]
  cmd = [
      sys.executable,
      "train.py",
      "--config",
      "configs/quickstart.py:smoke",
      "--workdir",
      str(workdir),
      *overrides,
  ]
  proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  metrics = workdir / "metrics.jsonl"
  try:
    deadline = time.monotonic() + 300
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):  # training under way
      assert proc.poll() is None, proc.communicate()[1][-3000:]
      assert time.monotonic() < deadline, "no training step logged within 300 s"
      time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=300)
  finally:
    if proc.poll() is None:  # never leave a 100,000-step run behind
      proc.kill()
      proc.wait()
  assert proc.returncode == 143, stderr[-3000:]
  assert "rerun the same command to resume" in stderr
  records = [json.loads(line) for line in metrics.read_text().splitlines()]
  assert records[-1]["kind"] == "preempted"
  stopped_at = records[-1]["step"]
  assert (workdir / "checkpoints" / str(stopped_at)).is_dir()
  assert not (workdir / "results.json").exists()  # resuming exactly: the in-process test above


@pytest.mark.subprocess
def test_quickstart_smoke_run_through_train_py(tmp_path):
  workdir = tmp_path / "qs"
  proc = _train_py(str(workdir), "--config.model.num_layers=1")
  assert proc.returncode == 0, proc.stderr[-3000:]
  results = json.loads((workdir / "results.json").read_text())
  assert results["step"] == 4
  assert np.isfinite(results["eval_loss"])
  assert (workdir / "checkpoints" / "4").is_dir()
  assert json.loads((workdir / "config.json").read_text())["model"]["num_layers"] == 1
  lines = (workdir / "metrics.jsonl").read_text().splitlines()
  kinds = [json.loads(line)["kind"] for line in lines]
  assert kinds.count("train") == 2 and kinds[-1] == "final"
  translations = (workdir / "test_translations.txt").read_text().splitlines()
  assert len(translations) == results["test_sentences"]
  # The reported BLEU is sacreBLEU's on the written translations against the test references.
  from configs import quickstart

  references = [
      t for _, t in pipeline.load_dataset(quickstart.get_config("smoke")).splits["test"].pairs
  ]
  expected = sacrebleu.corpus_bleu(translations, [references])
  assert results["test_bleu"] == pytest.approx(expected.score)
  assert results["test_bleu_signature"] == str(expected)


def _tensorboard_events(workdir):
  """(tag, step) -> scalar, and tag -> texts, read back from the event files with TensorFlow's
  reader (not the writer's library)."""
  tf = pytest.importorskip("tensorflow")
  scalars, texts = {}, {}
  files = sorted(pathlib.Path(workdir).glob("events.out.tfevents.*"))
  assert files, f"no TensorBoard event file in {workdir}"
  for path in files:
    for event in tf.compat.v1.train.summary_iterator(str(path)):
      for value in event.summary.value:
        if value.HasField("simple_value"):
          assert (value.tag, event.step) not in scalars, (value.tag, event.step)
          scalars[value.tag, event.step] = value.simple_value
        elif value.HasField("tensor"):
          text = tf.make_ndarray(value.tensor).item().decode()
          texts.setdefault(value.tag.removesuffix("/text_summary"), []).append(text)
  return scalars, texts


def test_every_metric_is_also_a_tensorboard_scalar(tmp_path):
  pytest.importorskip("tensorboardX")
  config = tiny_config(num_steps=4, log_every=2, eval_every=2, checkpoint_every=100)
  train.run(config, str(tmp_path), devices=jax.devices()[:1])
  expected = {}
  for record in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines()):
    for key, value in record.items():
      if key not in ("step", "kind") and isinstance(value, (int, float)):
        if not isinstance(value, bool):
          expected[f"{record['kind']}/{key}", record["step"]] = value
  assert {"train/loss", "eval/bleu", "final/test_bleu"} <= {tag for tag, _ in expected}
  scalars, texts = _tensorboard_events(tmp_path)
  assert scalars.keys() == expected.keys()
  for key, value in expected.items():
    assert scalars[key] == pytest.approx(value, rel=1e-6, abs=1e-30), key  # stored as float32
  samples = (tmp_path / "test_translations.txt").read_text().splitlines()[:3]
  assert len(texts["eval/translations"]) == 1  # the eval at step 2; step 4 is the final one
  assert texts["test/translations"][0].startswith(f"hyp: {samples[0]}")


def test_without_tensorboardx_metrics_go_to_metrics_jsonl_alone(tmp_path, monkeypatch, caplog):
  monkeypatch.setitem(sys.modules, "tensorboardX", None)  # `import tensorboardX` fails
  with caplog.at_level("INFO"):
    log = train.MetricLog(str(tmp_path))
  assert log.tensorboard is None and "tensorboardX is not installed" in caplog.text
  log.write(1, "train", {"loss": 2.5})
  log.text(1, "eval/translations", "hyp: a")
  log.close()
  assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {
      "step": 1,
      "kind": "train",
      "loss": 2.5,
  }
  assert not list(tmp_path.glob("events.out.tfevents.*"))
