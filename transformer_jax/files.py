"""Files and directories written whole: a reader (or a resumed run) never sees half of one.

Both write under a temporary name in the same directory and rename it into place, which POSIX
makes atomic on one file system.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from collections.abc import Callable

from transformer_jax import errors


def atomic_write(path: str, write: Callable[[str], object]) -> None:
  """`write(tmp_path)`, then a rename to `path`; the temporary file is removed on failure."""
  tmp = f"{path}.tmp{os.getpid()}"
  try:
    write(tmp)
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)


class atomic_dir:  # noqa: N801 - used as a function: `with atomic_dir(final) as tmp:`
  """`with atomic_dir(final, is_complete) as tmp:` fills tmp, then renames it to `final`.

  If another process renamed its copy first (the rename fails), that copy is kept when
  `is_complete(final)` says it is whole. Temporary directories left on this host by killed
  processes are removed on the way in.
  """

  def __init__(self, final: str, is_complete: Callable[[str], bool] = os.path.isdir):
    self.final, self.is_complete = final, is_complete

  def __enter__(self) -> str:
    parent, base = os.path.split(self.final)
    os.makedirs(parent, exist_ok=True)
    prefix = f".tmp-{base}-{socket.gethostname()}-"
    for name in os.listdir(parent):
      if name.startswith(prefix) and not _pid_alive(name[len(prefix) :].split("-")[0]):
        shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
    self.tmp = tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=parent)
    return self.tmp

  def __exit__(self, exc_type, exc, tb):
    if exc_type is not None:
      shutil.rmtree(self.tmp, ignore_errors=True)
      return False
    try:
      os.rename(self.tmp, self.final)
    except OSError:  # a racing process renamed its complete copy first: keep that one
      if not self.is_complete(self.final):
        raise
      shutil.rmtree(self.tmp, ignore_errors=True)
    return False


def _pid_alive(pid: str) -> bool:
  try:
    os.kill(int(pid), 0)
  except (ValueError, ProcessLookupError):
    return False
  except PermissionError:
    return True
  return True


def check_directory(path: str, flag: str = "--workdir") -> None:
  """A UserError unless `path` is a directory or can become one: no file stands at it or at any
  of its parents. Nothing is made."""
  current = os.path.abspath(path)
  while not os.path.exists(current):
    parent = os.path.dirname(current)
    if parent == current:
      return
    current = parent
  if not os.path.isdir(current):
    if current == os.path.abspath(path):
      raise errors.UserError(f"{flag} {path} is a file, not a directory (a new one or a run's)")
    raise errors.UserError(f"{flag} {path}: {current} is a file, not a directory")
