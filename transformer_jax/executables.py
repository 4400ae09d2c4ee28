"""Compiled programs kept on disk and loaded without tracing, so a warm `translate` starts fast.

JAX's persistent compilation cache keys a program by its lowered module, so a process that
finds a program there has already traced and lowered it. For the 49 programs of a beam search
over Multi30k test2016 that is ~7.5 of a 22 s `translate` (2-vCPU VM): tracing Flax modules
costs far more than loading the executable (~36 ms each). This cache keys a program by what
decides it before tracing — the function's name, its static arguments, and the shapes, dtypes
and shardings of its arguments — together with everything that could change the program behind
those (`fingerprint`: this package's source, the jax and jaxlib versions, the devices and CPU,
XLA flags), and keeps the executable itself (`jax.experimental.serialize_executable`). The name
must say whatever else decides the program, such as the model config a closure holds:

    cache = ExecutableCache(directory)
    out = cache(f"step {model_config!r}", jax.jit(step, static_argnames="n"), params, x, n=4)

Loading is itself ~1.6 s for those programs (rebuilding each HLO module), so the cache also
keeps, per name, the list of the programs the last process needed, in the order it needed
them; the first call of a name (or `prefetch(name)`) starts a thread that loads them in that
order while the first ones run (the loader releases the GIL: ~1 s less on the 2-vCPU VM). A
program the thread has not started on yet is loaded by the caller itself. `close()` stops it.

A file that cannot be read or loaded is reported and compiled again; files are written whole
(a temporary file renamed), so an interrupted run never leaves half a file under a real name.
Files are pickles: load only a directory you trust, like JAX's own cache.

It cannot be combined with JAX's persistent compilation cache: an executable that JAX's cache
loaded is not complete when serialized again (XLA:CPU, jax 0.10: the loaded copy fails at run
time with "Function ... not found"), so `ExecutableCache` refuses to start, or to compile, while
that cache is on.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import platform
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import jaxlib
from jax.experimental import serialize_executable

from transformer_jax import errors

SUFFIX = ".jaxexec"
# A kept program (or list) unused for this long is deleted when a program is next saved: every
# edit of the package makes all programs stale, and nothing else would ever remove them.
MAX_AGE_DAYS = 30
MAX_LISTED = 64  # programs prefetched per name, at most
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
# jax config values that change what a traced function lowers to.
_CONFIG_KEYS = (
    "jax_enable_x64",
    "jax_default_matmul_precision",
    "jax_numpy_rank_promotion",
    "jax_numpy_dtype_promotion",
    "jax_threefry_partitionable",
    "jax_default_prng_impl",
)


def package_source_hash() -> str:
  """sha256 of every .py file of this package (names and contents): a changed line of the model
  or the search makes every kept program stale."""
  digest = hashlib.sha256()
  for root, dirs, files in os.walk(_PACKAGE_DIR):
    dirs.sort()
    for name in sorted(files):
      if name.endswith(".py"):
        path = os.path.join(root, name)
        digest.update(os.path.relpath(path, _PACKAGE_DIR).encode())
        with open(path, "rb") as f:
          digest.update(f.read())
  return digest.hexdigest()


def _cpu_flags() -> str:
  """The host CPU's feature flags (XLA:CPU compiles for them: an executable made on a machine
  with AVX-512 must not be loaded on one without)."""
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith(("flags", "Features")):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor()


def fingerprint() -> str:
  """Everything outside a call's arguments that decides what it compiles to, on this process."""
  devices = jax.devices()
  client = devices[0].client
  parts = [
      f"jax {jax.__version__} jaxlib {jaxlib.__version__}",
      f"{client.platform} {client.platform_version}",
      f"process {jax.process_index()} of {jax.process_count()}",
      repr([(d.id, d.process_index, d.device_kind) for d in devices]),
      f"{platform.machine()} {_cpu_flags()}" if client.platform == "cpu" else "",
      "XLA_FLAGS=" + os.environ.get("XLA_FLAGS", ""),
      repr([(key, getattr(jax.config, key, None)) for key in _CONFIG_KEYS]),
      "source " + package_source_hash(),
  ]
  return "\n".join(parts)


@functools.lru_cache(maxsize=1024)
def _sharding_key(sharding) -> str:
  mesh = getattr(sharding, "mesh", None)
  if mesh is None or not hasattr(mesh, "devices"):
    return repr(sharding)
  ids = [d.id for d in mesh.devices.flat]  # the repr of a mesh omits which devices
  return f"{sharding!r} on {ids}"


def signature(name: str, args: tuple, static: dict) -> str:
  """What decides the program a jitted `name` compiles for `args` and `static` arguments."""
  leaves, tree = jax.tree.flatten(args)
  described = [
      (
          tuple(x.shape),
          str(x.dtype),
          _sharding_key(x.sharding) if isinstance(x, jax.Array) else type(x).__name__,
      )
      for x in leaves
  ]
  return f"{name}\n{sorted(static.items())!r}\n{tree}\n{described!r}"


def jax_cache_in_use() -> bool:
  return bool(jax.config.jax_compilation_cache_dir) and bool(
      jax.config.jax_enable_compilation_cache
  )


def _refuse_jax_cache():
  if jax_cache_in_use():
    raise errors.UserError(
        "the executable cache cannot be used while JAX's persistent compilation cache is "
        f"on (jax_compilation_cache_dir={jax.config.jax_compilation_cache_dir!r}): "
        "an executable loaded from JAX's cache cannot be saved again; turn one of them off"
    )


def _load(path: str):
  with open(path, "rb") as f:
    payload, in_tree, out_tree, device_ids = pickle.load(f)
  by_id = {d.id: d for d in jax.devices()}
  return serialize_executable.deserialize_and_load(
      payload, in_tree, out_tree, execution_devices=[by_id[i] for i in device_ids]
  )


def _touch(path: str):
  try:
    os.utime(path)
  except OSError:
    pass


def _serialize(program) -> bytes:
  """The pickled executable and the devices it runs on, in order (deserializing needs them;
  `serialize_executable.serialize` reads the same attribute of a `Compiled`)."""
  unloaded = program._executable._unloaded_executable
  devices = getattr(unloaded, "device_list", None) or unloaded.device_assignment  # jax versions
  return pickle.dumps((*serialize_executable.serialize(program), [d.id for d in devices]))


class ExecutableCache:
  """Compiles or loads a jitted function's program per call signature; see the module doc.

  `directory` None keeps programs in memory only (what `jax.jit` does, plus the counts).
  `loaded` and `compiled` count the programs this process took from disk and compiled.
  """

  def __init__(self, directory: str | None):
    _refuse_jax_cache()
    self.directory = os.path.abspath(os.path.expanduser(directory)) if directory else None
    self.loaded = self.compiled = 0
    self._programs: dict[str, Any] = {}  # signature -> program
    self._fingerprint: str | None = None
    self._can_write = True
    # Per name, the list of its programs' files as read (then written) and those used here.
    self._previous: dict[str, list[str]] = {}
    self._used: dict[str, list[str]] = {}
    # Prefetching: a thread per name loads its listed programs into `_ready`. `_pending` holds
    # the files a thread is still to load: a call needing one the thread is loading waits for
    # it, and takes over one it has not started on.
    self._condition = threading.Condition()
    self._ready: dict[str, Any] = {}
    self._pending: set[str] = set()
    self._loading: set[str] = set()  # being loaded by a thread now
    self._threads: list[threading.Thread] = []
    self._stop = False

  def __len__(self) -> int:
    """The programs held in memory."""
    return len(self._programs)

  def __call__(self, name: str, jitted: Callable, *args, **static):
    """`jitted(*args, **static)`, with its program compiled once and kept."""
    key = signature(name, args, static)
    program = self._programs.get(key)
    if program is None:
      self.prefetch(name)
      program = self._programs[key] = self._load_or_compile(name, key, jitted, args, static)
    return program(*args)

  def _hash(self, text: str) -> str:
    if self._fingerprint is None:
      self._fingerprint = fingerprint()
    return hashlib.sha256(f"{self._fingerprint}\n{text}".encode()).hexdigest()

  def path(self, key: str) -> str:
    """The file of the program with signature `key`."""
    return os.path.join(self.directory, self._hash(key) + SUFFIX)

  def _list_path(self, name: str) -> str:
    return os.path.join(self.directory, self._hash(f"programs of {name}") + ".order")

  def _read_list(self, name: str) -> list[str]:
    try:
      with open(self._list_path(name)) as f:
        files = [line.strip() for line in f if line.strip().endswith(SUFFIX)]
    except OSError:
      files = []
    else:
      _touch(self._list_path(name))  # used: not to be pruned
    files = list(dict.fromkeys(files))[:MAX_LISTED]  # in order, once each
    self._previous[name], self._used[name] = files, []
    return files

  def prefetch(self, name: str):
    """Starts loading, in a thread, the programs `name` needed before (once per name)."""
    if not self.directory or name in self._used:
      return
    paths = [os.path.join(self.directory, f) for f in self._read_list(name)]
    with self._condition:
      paths = [p for p in paths if p not in self._pending and p not in self._ready]
      self._pending.update(paths)
    if paths:
      thread = threading.Thread(target=self._prefetch, args=(paths,), name="ExecutableCache")
      self._threads.append(thread)
      thread.start()

  def _prefetch(self, paths: list[str]):
    for path in paths:
      with self._condition:
        if self._stop or path not in self._pending:  # stopped, or a caller took it over
          self._pending.discard(path)
          self._condition.notify_all()
          continue
        self._loading.add(path)
      try:
        program = _load(path)
      except Exception:  # noqa: BLE001 - the caller loads it again and reports why
        program = None
      with self._condition:
        if program is not None:
          self._ready[path] = program
        self._pending.discard(path)
        self._loading.discard(path)
        self._condition.notify_all()

  def close(self):
    """Stops prefetching (a program being loaded is finished) and drops unused programs."""
    self._stop = True
    for thread in self._threads:
      thread.join()
    self._threads.clear()
    self._ready.clear()

  def _prefetched(self, path: str):
    """The program at `path` if a prefetch thread loaded it (waiting while one loads it), or
    None: then the caller loads it itself, and no thread will."""
    with self._condition:
      while path in self._loading:
        self._condition.wait()
      self._pending.discard(path)
      return self._ready.pop(path, None)

  def _load_or_compile(self, name: str, key: str, jitted: Callable, args: tuple, static: dict):
    if not self.directory:
      self.compiled += 1
      return jitted.lower(*args, **static).compile()
    path = self.path(key)
    program = self._prefetched(path)
    if program is None and os.path.exists(path):
      try:
        program = _load(path)
      except Exception as e:  # noqa: BLE001 - any unreadable file is compiled again
        logging.warning(
            "compiled program %s cannot be loaded (%s: %s); compiling it again",
            path, type(e).__name__, str(e)[:200],
        )  # fmt: skip
    if program is not None:
      self.loaded += 1
      _touch(path)  # used: not to be pruned
    else:
      _refuse_jax_cache()
      program = jitted.lower(*args, **static).compile()
      self.compiled += 1
      if self._can_write:
        self._save(path, program)
    self._note(name, path)
    return program

  def _note(self, name: str, path: str):
    """Lists `path` among `name`'s programs: the list on disk becomes the programs this process
    used, in the order it first used them, then the rest of the list it found (at most
    `MAX_LISTED`), so the next process prefetches what this one needed first."""
    file = os.path.basename(path)
    used = self._used.setdefault(name, [])
    if file in used or not self._can_write:
      return
    used.append(file)
    rest = [f for f in self._previous.get(name, []) if f not in used]
    files = (used + rest)[:MAX_LISTED]
    if files == self._previous.get(name):
      return  # the same list
    self._previous[name] = files
    target = self._list_path(name)
    temporary = f"{target}.{os.getpid()}.tmp"
    try:
      with open(temporary, "w") as out:
        out.write("".join(line + "\n" for line in files))
      os.replace(temporary, target)
    except OSError as e:
      self._cannot_write(e)

  def _cannot_write(self, e: OSError):
    logging.warning("cannot keep compiled programs in %s (%s); going on without", self.directory, e)
    self._can_write = False

  def _save(self, path: str, program):
    if not self.compiled - 1:  # the first program this process saves
      self._prune()
    try:
      data = _serialize(program)
    except Exception as e:  # noqa: BLE001 - not every backend serializes; keep going
      logging.warning("compiled programs cannot be kept (%s: %s)", type(e).__name__, e)
      self._can_write = False
      return
    temporary = f"{path}.{os.getpid()}.tmp"
    try:
      os.makedirs(self.directory, exist_ok=True)
      with open(temporary, "wb") as f:
        f.write(data)
      os.replace(temporary, path)
    except OSError as e:
      self._cannot_write(e)

  def _prune(self):
    """Deletes the programs and lists of `directory` unused for `MAX_AGE_DAYS`."""
    oldest = time.time() - MAX_AGE_DAYS * 86400
    try:
      entries = list(os.scandir(self.directory))
    except OSError:
      return
    for entry in entries:
      if entry.name.endswith((SUFFIX, ".order", ".tmp")):
        try:
          if entry.stat().st_mtime < oldest:
            os.remove(entry.path)
        except OSError:
          pass  # another process removed it, or it is not ours to remove
