"""Digests of a checkpoint's files: what was saved is what is read back, or the reader says so.

Orbax and TensorStore check a checkpoint's structure (OCDBT's b-tree nodes and the zarr3 shard
indices carry CRC-32C checksums) but not the bytes of the array chunks: a flipped byte in a data
file restores as a different number, silently. So a checkpoint carries a record of each of its
files, its size and CRC-32, taken once Orbax has written the files and before it commits the
step (runs/checkpoint.py), and every reader checks the files against it before restoring.

The record is of files, not of values, so that taking it costs the save call nothing: it reads the
files Orbax has just written, in Orbax's background thread, where reading the arrays' values
would have to happen in the save call, before the next step donates them (docs/experiments.md).
The same files are read whatever the mesh that restores them, so an elastic resume checks them
alike. CRC-32 finds any change of up to 32 consecutive bits and misses other damage with
probability 2⁻³²; it detects damage (a disk, a copy, a sync cut short), not tampering.
"""

from __future__ import annotations

import json
import zlib

from etils import epath

RECORD = "digest.json"  # in the directory whose files it records
FORMAT = 2  # format 1 (no longer checked): digests of the arrays' values, in a `digest` item
_BLOCK = 1 << 24  # bytes read at a time; zlib releases the GIL for each


def crc32(path: epath.Path) -> str:
  """The CRC-32 of a file's bytes, 8 hex digits."""
  value = 0
  with path.open("rb") as f:
    while block := f.read(_BLOCK):
      value = zlib.crc32(block, value)
  return f"{value:08x}"


def _files(directory: epath.Path, subdirectories: bool) -> list[epath.Path]:
  """The files under `directory`, sorted (listed a directory at a time: a bucket has no
  recursive listing that epath offers)."""
  found, pending = [], [directory]
  while pending:
    for path in pending.pop().iterdir():
      if path.is_dir():
        pending.append(path)
      elif path.name != RECORD and not (subdirectories and path.parent == directory):
        found.append(path)
  return sorted(found)


def record_files(directory, subdirectories: bool = False) -> dict[str, list]:
  """{path relative to `directory`: [size, crc32]} for every file under `directory` (with
  `subdirectories`, only those in its subdirectories)."""
  directory = epath.Path(directory)
  return {
      str(p.relative_to(directory)): [p.stat().length, crc32(p)]
      for p in _files(directory, subdirectories)
  }


def damaged(directory, files: dict[str, list]) -> list[str]:
  """The files of `files` (a `record_files` record) missing under `directory` or changed, each
  as "path (why)"."""
  directory = epath.Path(directory)
  bad = []
  for name, (size, crc) in sorted(files.items()):
    path = directory / name
    if not path.is_file():
      bad.append(f"{name} (missing)")
    elif path.stat().length != size:
      bad.append(f"{name} ({path.stat().length} bytes, {size} written)")
    elif crc32(path) != crc:
      bad.append(f"{name} (other bytes)")
  return bad


def is_record(value) -> bool:
  """Whether `value` is a format-2 record: {"format": 2, "files": {name: [size, crc]}}."""
  if not isinstance(value, dict):
    return False
  files = value.get("files")
  return (
      value.get("format") == FORMAT
      and isinstance(files, dict)
      and all(
          isinstance(v, list) and len(v) == 2 and isinstance(v[0], int) and isinstance(v[1], str)
          for v in files.values()
      )
  )


def write(directory, files: dict[str, list]) -> None:
  """Writes the record of `files` as `directory/digest.json` (one write of a small file)."""
  text = json.dumps({"format": FORMAT, "files": files}, sort_keys=True)
  (epath.Path(directory) / RECORD).write_text(text)
