"""Multi-process training: two processes with 2 CPU devices each equal one process with 4.

The test launches this file as a script three times at once: two workers joined by
`jax.distributed.initialize` (through `config.distributed`, with gloo CPU collectives) and one
single-process reference with 4 fake devices. All train the same tiny config for a few steps on
a (fsdp=2, tensor=2) mesh with FSDP rules, so parameters are split across the two processes and
each process feeds only its half of every global batch. The two-process job also writes an Orbax
checkpoint collectively, which this (pytest) process then restores onto one device.
"""

import argparse
import contextlib
import json
import math
import os
import pathlib
import socket
import subprocess
import sys

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
VOCAB = 200
STEPS = 3
TIMEOUT_S = 420


def tiny_config():
  from testing import tiny_train_config

  config = tiny_train_config()
  config.data.tokens_per_batch = 384  # 16 rows of 24
  config.train.adam_eps = 1.0  # updates proportional to gradients (see test_sharding.py)
  config.train.lr_multiplier = 100.0
  config.mesh = {"data": 1, "fsdp": 2, "tensor": 2}
  config.sharding_rules = "fsdp"
  return config


# ----------------------------------------------------------------------------- the worker


def worker(args):
  """One process of the job (or the whole single-process reference). Writes, from process 0,
  `{out}/{name}.npz`: every parameter (gathered from all processes) and the step losses."""
  import jax
  from jax.experimental import multihost_utils

  from transformer_jax import config as config_lib
  from transformer_jax.data import batching, pipeline
  from transformer_jax.parallel import distributed
  from transformer_jax.runs import checkpoint
  from transformer_jax.training import train

  config = tiny_config()
  if args.num_processes > 1:
    config.distributed.enabled = True
    config.distributed.coordinator_address = f"127.0.0.1:{args.port}"
    config.distributed.num_processes = args.num_processes
    config.distributed.process_id = args.process_id
  config_lib.validate(config)
  distributed.initialize(config)
  assert jax.process_count() == args.num_processes and jax.device_count() == 4

  dataset = pipeline.load_dataset(config)
  trainer = train.Trainer(config, config_lib.model_config(config, VOCAB))
  train_iter = batching.BatchIterator(  # as train.run builds it
      dataset.splits["train"].examples,
      seed=config.seed,
      bucket_lengths=dataset.bucket_lengths(config.data),
      tokens_per_batch=config.data.tokens_per_batch,
      batch_multiple=math.lcm(trainer.num_batch_shards, jax.process_count()),
      process_index=jax.process_index(),
      process_count=jax.process_count(),
  )
  state = trainer.init_state(config.seed)
  rng = jax.random.PRNGKey(1)
  losses = []
  for _ in range(STEPS):
    batch = next(train_iter)
    assert batch["inputs"].shape[0] == 16 // jax.process_count()  # this process's rows only
    state, metrics = trainer.train_step(state, batch, rng)
    losses.append(float(metrics["loss_sum"]))

  if args.checkpoint_dir:
    manager = checkpoint.make_manager(args.checkpoint_dir, keep=1, save_every=1)
    checkpoint.save(manager, STEPS, state, train_iter.get_state(), force=True)
    manager.wait_until_finished()
    manager.close()

  # Parameters are sharded across processes: gather the global values on every process.
  params = multihost_utils.process_allgather(state.params, tiled=True)
  if jax.process_index() == 0:
    flat = {
        jax.tree_util.keystr(path): np.asarray(x)
        for path, x in jax.tree_util.tree_flatten_with_path(params)[0]
    }
    np.savez(os.path.join(args.out, f"{args.name}.npz"), losses=np.asarray(losses), **flat)


# ----------------------------------------------------------------------------- the test


def free_port() -> int:
  try:
    import portpicker

    return portpicker.pick_unused_port()
  except ImportError:
    with socket.socket() as s:
      s.bind(("127.0.0.1", 0))
      return s.getsockname()[1]


def popen_logged(command, log_path, **kwargs) -> subprocess.Popen:
  """Popen with stdout and stderr to `log_path`. Not a pipe: while the test waits on one process
  nobody reads the other's pipe, which fills at 64 KB and blocks that process in a write, and the
  first then waits for it forever in a collective or barrier (seen: a hang saving a checkpoint)."""
  with open(log_path, "w") as log:  # the child keeps its own descriptor
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True, **kwargs)
  proc.log_path = log_path
  return proc


def wait_for_logs(procs) -> list[str]:
  """Waits for every process (TIMEOUT_S each); their logs, in order."""
  for proc in procs:
    proc.wait(timeout=TIMEOUT_S)
  return [read_log(proc) for proc in procs]


def read_log(proc) -> str:
  return pathlib.Path(proc.log_path).read_text(errors="replace")


def launch(out, name, num_devices, num_processes=1, process_id=0, port=0, checkpoint_dir=""):
  env = {
      **os.environ,
      "JAX_PLATFORMS": "cpu",
      # Level 0 roughly halves XLA:CPU compile time; both sides of the comparison use it.
      "XLA_FLAGS": f"--xla_force_host_platform_device_count={num_devices} "
      "--xla_backend_optimization_level=0",
      "PYTHONPATH": str(REPO),
  }
  command = [
      sys.executable, __file__, "--out", str(out), "--name", name,
      "--num_processes", str(num_processes), "--process_id", str(process_id),
      "--port", str(port), "--checkpoint_dir", checkpoint_dir,
  ]  # fmt: skip
  return popen_logged(command, pathlib.Path(out) / f"{name}_{process_id}.log", cwd=REPO, env=env)


def wait_all(procs):
  try:
    logs = dict(zip(procs, wait_for_logs(procs.values())))
  finally:
    for proc in procs.values():  # only the processes this test started
      if proc.poll() is None:
        proc.kill()
        proc.wait()
  for name, proc in procs.items():
    assert proc.returncode == 0, f"{name} failed:\n{logs[name][-4000:]}"


@pytest.mark.subprocess
def test_two_processes_train_like_one_process_with_four_devices(tmp_path):
  import jax

  from transformer_jax import config as config_lib
  from transformer_jax.runs import checkpoint
  from transformer_jax.training import train

  port = free_port()
  ckpt = str(tmp_path / "checkpoints")
  procs = {
      f"process_{i}": launch(
          tmp_path, "two_processes", 2, num_processes=2, process_id=i, port=port,
          checkpoint_dir=ckpt,
      )
      for i in range(2)
  }  # fmt: skip
  procs["reference"] = launch(tmp_path, "one_process", 4)
  wait_all(procs)

  two = np.load(tmp_path / "two_processes.npz")
  one = np.load(tmp_path / "one_process.npz")
  assert set(two.files) == set(one.files) and len(one.files) > 10
  np.testing.assert_allclose(two["losses"], one["losses"], rtol=1e-6)
  for key in one.files:
    np.testing.assert_allclose(two[key], one[key], rtol=1e-6, atol=1e-7, err_msg=key)

  # The checkpoint the two processes wrote together restores on one device to the same values,
  # its files (both processes' data files) checked against the record process 0 wrote.
  record = json.loads((pathlib.Path(ckpt) / "checkpoints" / str(STEPS) / "digest.json").read_text())
  assert {"state/ocdbt.process_0", "state/ocdbt.process_1"} <= {
      name.rsplit("/d/", 1)[0] for name in record["files"]
  }
  config = tiny_config()
  config.mesh = {"data": 1, "fsdp": 1, "tensor": 1}
  trainer = train.Trainer(config, config_lib.model_config(config, VOCAB), devices=jax.devices()[:1])
  manager = checkpoint.make_manager(ckpt, keep=1, save_every=1)
  state, data_state = checkpoint.restore(manager, trainer.abstract_state())
  manager.close()
  assert int(state.step) == STEPS and data_state["batch"] == STEPS
  restored = {
      jax.tree_util.keystr(path): np.asarray(x)
      for path, x in jax.tree_util.tree_flatten_with_path(state.params)[0]
  }
  for key, value in restored.items():
    np.testing.assert_array_equal(value, two[key], err_msg=key)


@contextlib.contextmanager
def two_train_py_processes(workdir, *args):
  """train.py as two processes of one job (2 CPU devices each), each logging to a file beside
  `workdir` (`read_log`); whatever is still running at the end of the block is killed."""
  port = free_port()
  env = {
      **os.environ,
      "JAX_PLATFORMS": "cpu",
      "XLA_FLAGS": "--xla_force_host_platform_device_count=2 --xla_backend_optimization_level=0",
  }
  session = len(list(workdir.parent.glob("process_0.*.log")))  # a new log per session
  procs = [
      popen_logged(
          [sys.executable, "train.py", "--config", "configs/quickstart.py:smoke",
           "--workdir", str(workdir), *args, "--config.distributed.enabled=True",
           f"--config.distributed.coordinator_address=127.0.0.1:{port}",
           "--config.distributed.num_processes=2", f"--config.distributed.process_id={i}"],
          workdir.parent / f"process_{i}.{session}.log", cwd=REPO, env=env,
      )
      for i in range(2)
  ]  # fmt: skip
  try:
    yield procs
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()


@pytest.mark.subprocess
def test_sigterm_to_one_process_stops_both_at_the_same_checkpointed_step(tmp_path):
  """JAX's preemption service: only process 1 gets SIGTERM, yet both save the same step, skip
  the final evaluation and exit 143 (preemption.py)."""
  import signal
  import time

  workdir = tmp_path / "run"
  with two_train_py_processes(
      workdir,
      "--config.train.num_steps=100000",
      "--config.train.log_every=1",
      "--config.train.checkpoint_every=1000",
  ) as procs:
    metrics = workdir / "metrics.jsonl"  # written by process 0 only
    deadline = time.monotonic() + TIMEOUT_S
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
      assert all(p.poll() is None for p in procs), [read_log(p)[-2000:] for p in procs]
      assert time.monotonic() < deadline, "no training step logged in time"
      time.sleep(0.2)
    procs[1].send_signal(signal.SIGTERM)
    logs = wait_for_logs(procs)
  assert [p.returncode for p in procs] == [143, 143], [log[-3000:] for log in logs]
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert records[-1]["kind"] == "preempted"
  stopped_at = records[-1]["step"]
  assert (workdir / "checkpoints" / str(stopped_at)).is_dir()  # off the 1000-step interval
  assert not (workdir / "results.json").exists()
  for log in logs:
    assert f"preempted at step {stopped_at}" in log


@pytest.mark.subprocess
def test_two_processes_set_aside_an_unreadable_checkpoint_together_and_resume(tmp_path):
  """checkpoint.restore_newest_readable with two processes: both find step 4 unreadable (an
  allgather), process 0 moves it aside, a barrier, and both resume from step 2."""
  workdir = tmp_path / "run"
  from testing import tiny_overrides

  tiny = [f"--config.{key}={value}" for key, value in tiny_overrides().items()]

  def train_two_processes(num_steps):
    with two_train_py_processes(
        workdir,
        *tiny,
        f"--config.train.num_steps={num_steps}",
        "--config.train.checkpoint_every=2",
        "--config.train.keep_checkpoints=5",
    ) as procs:
      logs = wait_for_logs(procs)
    assert [p.returncode for p in procs] == [0, 0], [log[-3000:] for log in logs]
    return logs

  train_two_processes(4)
  checkpoints = workdir / "checkpoints"

  def saved_steps():
    return {int(p.name) for p in checkpoints.iterdir() if p.name.isdigit()}

  assert max(saved_steps()) == 4 and 2 in saved_steps()
  damaged = [f for f in (checkpoints / "4" / "state").rglob("*") if f.parent.name == "d"]
  assert damaged
  for f in damaged:
    f.write_bytes(b"not a chunk")

  logs = train_two_processes(6)
  assert (workdir / "checkpoints.unreadable" / "4" / "state").is_dir()  # moved once, by process 0
  assert sorted(p.name for p in (workdir / "checkpoints.unreadable").iterdir()) == ["4"]
  assert "moved to" in logs[0] and "moved to" not in logs[1]
  assert all("checkpoint step 4" in log for log in logs)  # each process reports the failure
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  starts = [r["step"] for r in records if r["kind"] == "start"]
  assert starts == [0, 2]  # the second session resumed from step 2
  assert json.loads((workdir / "results.json").read_text())["step"] == 6
  assert {2, 4, 6} <= saved_steps()  # step 4 saved again, from the redone steps


def train_py(workdir, num_devices, *args):
  """train.py as one process with `num_devices` CPU devices; returns its log."""
  env = {
      **os.environ,
      "JAX_PLATFORMS": "cpu",
      "XLA_FLAGS": f"--xla_force_host_platform_device_count={num_devices} "
      "--xla_backend_optimization_level=0",
  }
  workdir.parent.mkdir(parents=True, exist_ok=True)
  session = len(list(workdir.parent.glob("single.*.log")))
  proc = popen_logged(
      [sys.executable, "train.py", "--config", "configs/quickstart.py:smoke",
       "--workdir", str(workdir), *args],
      workdir.parent / f"single.{session}.log", cwd=REPO, env=env,
  )  # fmt: skip
  try:
    (log,) = wait_for_logs([proc])
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  assert proc.returncode == 0, log[-3000:]
  return log


@pytest.mark.subprocess
def test_elastic_resume_two_processes_to_one_and_one_to_two(tmp_path):
  """A run checkpointed by 2 processes (4 devices) resumes as 1 process with 1 device, and one by
  1 process resumes as 2 processes: both end at the parameters of an uninterrupted run, because
  the checkpoint's data state fixes the global batches (BatchIterator.set_state keeps its rows)."""
  import jax
  from testing import tiny_overrides

  from transformer_jax import config as config_lib
  from transformer_jax.data import pipeline
  from transformer_jax.runs import checkpoint
  from transformer_jax.training import train

  flags = [f"--config.{key}={value}" for key, value in tiny_overrides().items()]
  flags += ["--config.train.checkpoint_every=2", "--config.train.keep_checkpoints=5"]

  def two_processes(workdir, num_steps):
    workdir.parent.mkdir(parents=True, exist_ok=True)
    with two_train_py_processes(workdir, *flags, f"--config.train.num_steps={num_steps}") as procs:
      logs = wait_for_logs(procs)
    assert [p.returncode for p in procs] == [0, 0], [log[-3000:] for log in logs]

  reference = tmp_path / "reference" / "run"
  train_py(reference, 4, *flags, "--config.train.num_steps=4")
  two_to_one = tmp_path / "two_to_one" / "run"
  two_processes(two_to_one, 2)
  log = train_py(two_to_one, 1, *flags, "--config.train.num_steps=4")
  assert "keeping the checkpoint's global rows" in log  # 1 device alone would round otherwise
  one_to_two = tmp_path / "one_to_two" / "run"
  train_py(one_to_two, 4, *flags, "--config.train.num_steps=2")
  two_processes(one_to_two, 4)

  config = tiny_config()
  config.mesh = {"data": 1, "fsdp": 1, "tensor": 1}
  vocab_size = pipeline.load_dataset(config).tokenizer.vocab_size
  trainer = train.Trainer(
      config, config_lib.model_config(config, vocab_size), devices=jax.devices()[:1]
  )

  def final(workdir):
    manager = checkpoint.make_manager(str(workdir), keep=5, save_every=1)
    state, data_state = checkpoint.restore(manager, trainer.abstract_state())
    manager.close()
    assert int(state.step) == 4
    return jax.tree.leaves(state.params), {k: data_state[k] for k in ("epoch", "batch", "rows")}

  for workdir in (two_to_one, one_to_two):  # two sessions each, the second from step 2
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "start"] == [0, 2]
  want, want_data = final(reference)
  for workdir in (two_to_one, one_to_two):
    got, got_data = final(workdir)
    assert got_data == want_data
    for a, b in zip(got, want):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.subprocess
def test_process_0_prepares_the_corpus_and_the_other_process_opens_it(tmp_path):
  from test_pipeline import small_corpus
  from testing import tiny_overrides

  corpus = tmp_path / "corpus"
  corpus.mkdir()
  small_corpus(corpus)
  flags = [f"--config.{key}={value}" for key, value in tiny_overrides().items()]
  flags += [
      "--config.data.source=text",
      f"--config.data.path={corpus}",
      "--config.data.vocab_size=120",
      "--config.train.num_steps=2",
  ]
  workdir = tmp_path / "runs" / "run"
  workdir.parent.mkdir(parents=True)
  with two_train_py_processes(workdir, *flags) as procs:
    logs = wait_for_logs(procs)
  assert [p.returncode for p in procs] == [0, 0], [log[-3000:] for log in logs]
  assert "tokenized 400 pairs of train" in logs[0]
  assert "tokenized" not in logs[1] and "reused" in logs[1]  # waited, then opened the same one
  prepared = [p for p in (tmp_path / "runs" / "prepared").iterdir() if not p.name.startswith(".")]
  assert len(prepared) == 1 and (workdir / "vocab.model").exists()


def test_distributed_config_is_validated_and_off_by_default():
  import pytest

  from transformer_jax import config as config_lib
  from transformer_jax.parallel import distributed

  config = tiny_config()
  assert distributed.initialize(config) is False  # enabled=False: a single-process run
  for key, value, expected in [
      ("process_id", 2, "distributed.process_id"),
      ("coordinator_address", "localhost", "distributed.coordinator_address"),
      ("cpu_collectives", "nccl", "distributed.cpu_collectives"),
  ]:
    bad = tiny_config()
    bad.distributed.num_processes = 2
    bad.distributed[key] = value
    with pytest.raises(config_lib.ConfigError, match=expected):
      config_lib.validate(bad)


if __name__ == "__main__":
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", required=True)
  parser.add_argument("--name", required=True)
  parser.add_argument("--num_processes", type=int, default=1)
  parser.add_argument("--process_id", type=int, default=0)
  parser.add_argument("--port", type=int, default=0)
  parser.add_argument("--checkpoint_dir", default="")
  worker(parser.parse_args())
