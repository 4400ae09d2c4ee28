"""Files and directories written whole, and a run's JSON files read back or refused in one line.

`atomic_write` and `atomic_dir` write under a temporary name in the same directory and rename it
into place, which POSIX makes atomic on one file system: a reader (or a resumed run) never sees
half of one. A file can still be damaged after it was written (a disk filling up, a copy cut
short, an edit): `read_json` and `read_json_lines` answer that with one UserError naming the file
(and line) and what to do, never a traceback.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

from transformer_jax import errors

# What to do about a damaged file of a run's workdir, unless its reader knows better.
DAMAGED = "the file is damaged or cut short; restore it from a copy or retrain in a new --workdir"
_KINDS = {dict: "a JSON object", list: "a JSON array", str: "a JSON string"}


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


def read_json(path: str, expect: type = dict, keys: Sequence[str] = (), fix: str = DAMAGED) -> Any:
  """The JSON value in `path`: one `expect` (dict: an object) holding `keys`.

  A missing or unreadable file, an empty one, one cut short or otherwise not valid JSON (or not
  UTF-8), and valid JSON of another shape (a list for an object, a missing key) are each a
  UserError naming `path` and what is wrong, then `fix`: what the user can do.
  """
  return parse_json(_read_bytes(path), path, expect, keys, fix)


def parse_json(
    data: bytes, name: str, expect: type = dict, keys: Sequence[str] = (), fix: str = DAMAGED
) -> Any:
  """`read_json` of a file's bytes already read (from a path `open` cannot take, as etils.epath's
  gs://); `name` names the file in the messages."""
  text = _decode(data, name, fix)
  if not text.strip():
    raise errors.UserError(f"{name} is empty: {fix}")
  try:
    value = json.loads(text)
  except json.JSONDecodeError as e:
    raise errors.UserError(
        f"{name} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}): {fix}"
    ) from None
  _check_shape(value, expect, keys, name, fix)
  return value


def read_json_lines(
    path: str, keys: Sequence[str] = (), fix: str = DAMAGED, skip_cut_last: bool = True
) -> list[dict]:
  """The JSON objects of `path`, one a line (blank lines skipped), each holding `keys`.

  A line that is not one is a UserError naming `path`, the line number and `fix`. With
  `skip_cut_last`, a last line that fails and has no line end (the record a writer was killed
  in the middle of) is left out with a warning instead: the records before it are whole.
  """
  text = _decode(_read_bytes(path), path, fix)
  lines = text.split("\n")  # the last item: what follows the last line end ("" if none)
  records = []
  for number, line in enumerate(lines, start=1):
    if not line.strip():
      continue
    where = f"{path} line {number}"
    try:
      record = json.loads(line)
    except json.JSONDecodeError as e:
      if skip_cut_last and number == len(lines):
        logging.warning("%s is cut short (%s): left out, a writer stopped inside it", where, e.msg)
        break
      raise errors.UserError(
          f"{where} is not valid JSON (column {e.colno}: {e.msg}): {fix}"
      ) from None
    _check_shape(record, dict, keys, where, fix)
    records.append(record)
  return records


def _read_bytes(path: str) -> bytes:
  try:
    with open(path, "rb") as f:
      return f.read()
  except FileNotFoundError:
    raise errors.UserError(f"{path} does not exist") from None
  except OSError as e:
    raise errors.UserError(f"{path} cannot be read ({e.strerror})") from None


def _decode(data: bytes, name: str, fix: str) -> str:
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError as e:
    raise errors.UserError(
        f"{name} is not UTF-8 text (byte {data[e.start]:#04x} at offset {e.start}): {fix}"
    ) from None


def _check_shape(value: Any, expect: type, keys: Sequence[str], where: str, fix: str) -> None:
  if not isinstance(value, expect):
    kind = next((k for t, k in _KINDS.items() if isinstance(value, t)), type(value).__name__)
    if value is None or isinstance(value, (bool, int, float)):
      kind = f"the JSON value {json.dumps(value)}"
    wanted = _KINDS.get(expect, expect.__name__)
    raise errors.UserError(f"{where} holds {kind} where {wanted} is expected: {fix}")
  missing = [k for k in keys if k not in value]
  if missing:
    raise errors.UserError(f"{where} lacks {missing}: {fix}")
