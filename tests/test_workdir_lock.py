"""One writer per run directory: a second training on a held workdir is refused, naming the holder;
a killed holder's lock blocks nothing."""

import errno
import fcntl
import json
import logging
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from testing import tiny_overrides, tiny_train_config

from transformer_jax import config as config_lib
from transformer_jax.data import pipeline
from transformer_jax.runs import checkpoint, workdir_lock
from transformer_jax.training import train

REPO = pathlib.Path(__file__).resolve().parents[1]
TIMEOUT_S = 600


def test_a_second_training_on_a_held_workdir_is_refused_naming_the_holder(tmp_path):
  (tmp_path / "notes.txt").write_text("mine\n")
  with workdir_lock.hold(str(tmp_path), "train"):
    holder = json.loads((tmp_path / workdir_lock.LOCK_FILE).read_text())
    assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
    with pytest.raises(workdir_lock.LockedError) as raised:
      train.run(tiny_train_config(), str(tmp_path), devices=jax.devices()[:1])
  message = str(raised.value)
  assert message.startswith(f"--workdir {tmp_path} is in use by train (PID {os.getpid()} on host ")
  assert "\n" not in message and "one run directory has one writer" in message
  # Refused before it wrote anything: no config.json, vocabulary, metrics or checkpoints.
  assert sorted(os.listdir(tmp_path)) == [workdir_lock.LOCK_FILE, "notes.txt"]
  # Released at the end of the block, and the holder's details with it.
  assert (tmp_path / workdir_lock.LOCK_FILE).read_text() == ""
  with workdir_lock.hold(str(tmp_path), "average"):
    assert json.loads((tmp_path / workdir_lock.LOCK_FILE).read_text())["command"] == "average"


def test_a_stale_holder_in_the_lock_file_blocks_nothing(tmp_path):
  # What a process killed with SIGKILL leaves: its details, but no lock (the OS dropped it).
  stale = {"pid": 999999, "host": socket.gethostname(), "command": "train", "since": "then"}
  (tmp_path / workdir_lock.LOCK_FILE).write_text(json.dumps(stale))
  with workdir_lock.hold(str(tmp_path), "train"):
    assert json.loads((tmp_path / workdir_lock.LOCK_FILE).read_text())["pid"] == os.getpid()


def test_the_other_processes_of_a_run_take_no_lock_and_follow_process_0(tmp_path, monkeypatch):
  from transformer_jax.parallel import distributed

  monkeypatch.setattr(distributed, "is_chief", lambda: False)
  monkeypatch.setattr(distributed, "chief_decides", lambda flag: False)  # process 0 got it
  with workdir_lock.hold(str(tmp_path), "train"):
    assert not (tmp_path / workdir_lock.LOCK_FILE).exists()  # taken once per run, by process 0
  monkeypatch.setattr(distributed, "chief_decides", lambda flag: True)  # process 0 was refused
  with pytest.raises(workdir_lock.LockedError, match="in use by another run .process 0 names it"):
    with workdir_lock.hold(str(tmp_path), "train"):
      pass


def test_a_filesystem_without_locks_warns_and_goes_on(tmp_path, monkeypatch, caplog):
  def unsupported(fd, operation):
    raise OSError(errno.ENOSYS, "Function not implemented")

  monkeypatch.setattr(fcntl, "flock", unsupported)
  with caplog.at_level(logging.WARNING), workdir_lock.hold(str(tmp_path), "train"):
    pass
  assert "does not support locks" in caplog.text and "one command on it at a time" in caplog.text


@pytest.mark.subprocess
def test_the_lock_of_a_killed_holder_is_gone_at_once(tmp_path):
  holder = subprocess.Popen(
      [sys.executable, "-c",
       "import sys, time\n"
       "from transformer_jax.runs import workdir_lock\n"
       f"with workdir_lock.hold({str(tmp_path)!r}, 'train'):\n"
       "  print('held', flush=True)\n"
       "  time.sleep(600)\n"],
      cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"},
      stdout=subprocess.PIPE, text=True,
  )  # fmt: skip
  try:
    assert holder.stdout.readline() == "held\n"
    with pytest.raises(workdir_lock.LockedError, match=f"PID {holder.pid} on host"):
      with workdir_lock.hold(str(tmp_path), "train"):
        pass
  finally:
    holder.kill()  # SIGKILL: no finally of its own runs
    holder.wait()
  with workdir_lock.hold(str(tmp_path), "train"):  # at once, no waiting and no cleaning up
    pass


# ----------------------------------------------------------------------------- train.py itself

FLAGS = [f"--config.{key}={value}" for key, value in tiny_overrides().items()] + [
    "--config.train.num_steps=6",
    "--config.train.checkpoint_every=2",
]


def _train_py(workdir: pathlib.Path, log: str) -> subprocess.Popen:
  env = {
      **os.environ,
      "PYTHONPATH": str(REPO),
      "JAX_PLATFORMS": "cpu",
      "XLA_FLAGS": "--xla_force_host_platform_device_count=1 --xla_backend_optimization_level=0",
  }
  command = [sys.executable, "train.py", "--config", "configs/quickstart.py:smoke",
             "--workdir", str(workdir), *FLAGS]  # fmt: skip
  with open(workdir.parent / log, "w") as out:  # a file, not a pipe that could fill
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)


def _finish(proc: subprocess.Popen, workdir: pathlib.Path, log: str) -> tuple[int, str]:
  try:
    proc.wait(timeout=TIMEOUT_S)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  return proc.returncode, (workdir.parent / log).read_text(errors="replace")


def _wait_until(condition, proc):
  deadline = time.monotonic() + TIMEOUT_S
  while not condition():
    assert proc.poll() is None, "the process ended first"
    assert time.monotonic() < deadline
    time.sleep(0.05)


def _holds_lock(workdir, proc):
  def check():
    try:
      return json.loads((workdir / workdir_lock.LOCK_FILE).read_text())["pid"] == proc.pid
    except (OSError, ValueError):
      return False

  return check


def _final_state(workdir):
  config = tiny_train_config()
  config.mesh = {"data": 1, "fsdp": 1, "tensor": 1}
  vocab_size = pipeline.load_dataset(config).tokenizer.vocab_size
  trainer = train.Trainer(
      config, config_lib.model_config(config, vocab_size), devices=jax.devices()[:1]
  )
  manager = checkpoint.make_manager(str(workdir), keep=5, save_every=1)
  state, data_state = checkpoint.restore(manager, trainer.abstract_state())
  manager.close()
  assert int(state.step) == 6
  return jax.tree.leaves((state.params, state.opt_state)), {
      k: data_state[k] for k in ("epoch", "batch", "rows")
  }


@pytest.mark.subprocess
def test_two_trainings_on_one_workdir_and_a_killed_one_resumed(tmp_path):
  """The second of two train.py on one workdir is refused in one line naming the first, which
  finishes with the parameters of an undisturbed run; a run killed with SIGKILL resumes at once
  to the same parameters."""
  runs = {name: tmp_path / name for name in ("undisturbed", "shared", "killed")}
  status, log = _finish(_train_py(runs["undisturbed"], "u.log"), runs["undisturbed"], "u.log")
  assert status == 0, log[-3000:]

  first = _train_py(runs["shared"], "first.log")
  try:
    _wait_until(_holds_lock(runs["shared"], first), first)
    first.send_signal(signal.SIGSTOP)  # the first run holds the workdir while the second starts
    before = sorted(p.name for p in runs["shared"].rglob("*"))
    status, log = _finish(_train_py(runs["shared"], "second.log"), runs["shared"], "second.log")
    lines = [line for line in log.splitlines() if line.strip()]
    assert status == 1 and len(lines) == 1, log[-3000:]
    assert lines[0].startswith(f"error: --workdir {runs['shared']} is in use by train (PID ")
    assert f"PID {first.pid} on host {socket.gethostname()}" in lines[0]
    assert sorted(p.name for p in runs["shared"].rglob("*")) == before  # it wrote nothing
  finally:
    first.send_signal(signal.SIGCONT)
  status, log = _finish(first, runs["shared"], "first.log")
  assert status == 0, log[-3000:]

  killed = _train_py(runs["killed"], "killed.log")
  _wait_until(lambda: (runs["killed"] / "metrics.jsonl").exists(), killed)  # it is training
  killed.send_signal(signal.SIGKILL)
  killed.wait()
  status, log = _finish(_train_py(runs["killed"], "resumed.log"), runs["killed"], "resumed.log")
  assert status == 0 and "in use by" not in log, log[-3000:]

  want_state, want_data = _final_state(runs["undisturbed"])
  for name in ("shared", "killed"):
    state, data = _final_state(runs[name])
    assert data == want_data, name
    for a, b in zip(state, want_state):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
  records = [json.loads(r) for r in (runs["shared"] / "metrics.jsonl").read_text().splitlines()]
  assert [r["kind"] for r in records].count("start") == 1  # one writer
