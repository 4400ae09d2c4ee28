"""One writer per run directory: an operating-system lock on `WORKDIR/.lock`.

`hold(workdir, command)` takes an exclusive `fcntl.flock` on the lock file, without waiting, and
writes who holds it (PID, host, command, since when) into the file. A second writer -- the same
training command typed in another terminal, or `average` while the run trains -- is refused with
a `LockedError` naming the holder, before it writes anything. The lock belongs to the open file,
so it dies with the process: a run killed with SIGKILL, or a lost machine, leaves a file that
blocks nothing, and the same command resumes at once. Nothing is ever deleted: removing a lock
file races with the next process that opens it.

Who takes it: training, and `average` (it writes `averaged/`, which a run's final evaluation
writes too, from checkpoints a training run deletes as it goes). Commands that read a run or
write files of their own beside it (translate, tune_decoding, plot, plot_attention) take none, so
they work while it trains.

Multi-process runs take it once: process 0 locks and every process learns the answer
(`distributed.chief_decides`), so all of them stop, or none.

A filesystem may not support `flock` (some FUSE mounts of buckets report ENOSYS or EOPNOTSUPP;
gcsfuse keeps locks on the host that took them). There the run goes on with a warning that
nothing stops a second writer: a run must stay possible on a bucket, and its user keeps one
command per workdir.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import time
from collections.abc import Iterator

from transformer_jax import errors
from transformer_jax.parallel import distributed

LOCK_FILE = ".lock"
# What a filesystem without locks answers (NFS without a lock manager: ENOLCK).
_UNSUPPORTED = {errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK, errno.EINVAL}


class LockedError(errors.UserError):
  """The workdir is held by another live process; the message names it."""


def _holder(fd: int) -> str:
  """Who holds the lock, from what it wrote into the file (may be empty for a moment)."""
  try:
    text = os.pread(fd, 4096, 0).decode("utf-8", "replace")
    info = json.loads(text)
    return f"{info['command']} (PID {info['pid']} on host {info['host']}, since {info['since']})"
  except (OSError, ValueError, KeyError, TypeError):
    return "another process (it has not written its name yet)"


def _acquire(path: str, command: str) -> tuple[int | None, str]:
  """(descriptor, "") when this process now holds the lock; (None, holder) when another does;
  (None, "") when the filesystem has no locks (a warning is logged)."""
  fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    holder = _holder(fd)
    os.close(fd)
    return None, holder
  except OSError as e:
    os.close(fd)
    if e.errno not in _UNSUPPORTED:
      raise
    logging.warning(
        "%s: this filesystem does not support locks (%s); nothing stops a second process "
        "from writing into this workdir, so run one command on it at a time",
        path,
        e.strerror,
    )
    return None, ""
  info = {
      "pid": os.getpid(),
      "host": socket.gethostname(),
      "command": command,
      "since": time.strftime("%Y-%m-%d %H:%M:%S"),
  }
  os.ftruncate(fd, 0)
  os.pwrite(fd, json.dumps(info).encode() + b"\n", 0)
  return fd, ""


@contextlib.contextmanager
def hold(workdir: str, command: str) -> Iterator[None]:
  """Holds `workdir`'s lock for the block; a LockedError if a live process holds it.

  With several processes, process 0 takes the lock and all of them raise if it could not.
  `workdir` must exist. `command` names this writer in the refusal the next one gets.
  """
  fd, holder = None, ""
  if distributed.is_chief():
    fd, holder = _acquire(os.path.join(workdir, LOCK_FILE), command)
  if distributed.chief_decides(bool(holder)):
    raise LockedError(
        f"--workdir {workdir} is in use by {holder or 'another run (process 0 names it)'}: one "
        "run directory has one writer. Wait for it to end or stop it (the same command then "
        "resumes), or use another --workdir."
    )
  try:
    yield
  finally:
    if fd is not None:
      os.ftruncate(fd, 0)  # the next reader finds no stale holder
      os.close(fd)  # releases the lock
