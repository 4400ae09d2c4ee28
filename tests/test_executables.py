"""The executable cache: programs kept on disk are loaded, not traced, and give the same results."""

import logging
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from testing import random_params

from transformer_jax import decode, errors, executables, sharding
from transformer_jax.data.tokenizer import EOS_ID
from transformer_jax.model import TransformerConfig

TRACES = []


def _affine(x, w, power):
  TRACES.append((x.shape, power))  # runs only when JAX traces
  return (x @ w) ** power


AFFINE = jax.jit(_affine, static_argnames="power")


def _files(directory, suffix=executables.SUFFIX):
  return sorted(f for f in os.listdir(directory) if f.endswith(suffix))


def test_programs_are_loaded_from_disk_without_tracing(tmp_path):
  x, w = jnp.arange(12.0).reshape(3, 4), jnp.ones((4, 2))
  TRACES.clear()
  first = executables.ExecutableCache(str(tmp_path))
  a = first("affine", AFFINE, x, w, power=2)
  b = first("affine", AFFINE, x, w, power=3)
  first("affine", AFFINE, x, w, power=2)  # held in memory: neither traced nor compiled again
  assert (first.compiled, first.loaded, len(first), len(TRACES)) == (2, 0, 2, 2)
  assert len(_files(tmp_path)) == 2 and len(_files(tmp_path, ".order")) == 1
  np.testing.assert_array_equal(a, (x @ w) ** 2)

  second = executables.ExecutableCache(str(tmp_path))  # as a new process would
  np.testing.assert_array_equal(second("affine", AFFINE, x, w, power=2), a)
  np.testing.assert_array_equal(second("affine", AFFINE, x, w, power=3), b)
  assert (second.compiled, second.loaded, len(TRACES)) == (0, 2, 2)  # nothing traced
  second.close()

  # Another shape, static argument or name is another program.
  third = executables.ExecutableCache(str(tmp_path))
  third("affine", AFFINE, x[:2], w, power=2)
  third("affine", AFFINE, x, w, power=4)
  third("other", AFFINE, x, w, power=2)
  assert (third.compiled, third.loaded) == (3, 0)
  assert len(_files(tmp_path)) == 5
  third.close()


def test_the_next_process_prefetches_what_the_last_one_needed_in_its_order(tmp_path):
  x, w = jnp.ones((2, 4)), jnp.ones((4, 2))

  def files(*powers):
    return [
        os.path.basename(first.path(executables.signature("affine", (x, w), {"power": p})))
        for p in powers
    ]

  def listed():
    (name,) = _files(tmp_path, ".order")
    return (tmp_path / name).read_text().split()

  first = executables.ExecutableCache(str(tmp_path))
  first("affine", AFFINE, x, w, power=2)
  first("affine", AFFINE, x, w, power=3)
  assert listed() == files(2, 3)
  second = executables.ExecutableCache(str(tmp_path))
  second("affine", AFFINE, x, w, power=4)  # compiled; its first call started the prefetch
  for thread in second._threads:
    thread.join()
  assert sorted(second._ready) == sorted(str(tmp_path / f) for f in files(2, 3))
  second("affine", AFFINE, x, w, power=3)
  assert (second.compiled, second.loaded) == (1, 1)
  assert listed() == files(4, 3, 2)  # this process's order first, then the rest
  second.close()
  assert not second._ready and not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


def test_a_changed_source_or_device_set_makes_programs_stale(tmp_path, monkeypatch):
  x, w = jnp.ones((2, 4)), jnp.ones((4, 2))
  executables.ExecutableCache(str(tmp_path))("affine", AFFINE, x, w, power=2)
  monkeypatch.setattr(executables, "package_source_hash", lambda: "edited")
  edited = executables.ExecutableCache(str(tmp_path))
  edited("affine", AFFINE, x, w, power=2)
  assert (edited.compiled, edited.loaded) == (1, 0)
  monkeypatch.undo()
  # The same shapes laid out over other devices are another program.
  placed = {}
  for devices in (jax.devices()[:2], jax.devices()[2:4]):
    mesh = jax.make_mesh((2,), ("data",), devices=devices)
    cache = executables.ExecutableCache(str(tmp_path))
    spread = jax.device_put(x, NamedSharding(mesh, P("data")))
    out = cache("affine", AFFINE, spread, jax.device_put(w, NamedSharding(mesh, P())), power=2)
    np.testing.assert_array_equal(out, (x @ w) ** 2)
    assert (cache.compiled, cache.loaded) == (1, 0)
    placed[devices[0].id] = {d.id for d in out.sharding.device_set}
  assert placed == {0: {0, 1}, 2: {2, 3}}


def test_an_unreadable_program_is_reported_and_compiled_again(tmp_path, caplog):
  x, w = jnp.ones((2, 4)), jnp.full((4, 2), 2.0)
  executables.ExecutableCache(str(tmp_path))("affine", AFFINE, x, w, power=2)
  (path,) = [tmp_path / f for f in _files(tmp_path)]
  path.write_bytes(path.read_bytes()[:100])  # cut short, as by a full disk
  again = executables.ExecutableCache(str(tmp_path))
  with caplog.at_level(logging.WARNING):
    np.testing.assert_array_equal(again("affine", AFFINE, x, w, power=2), (x @ w) ** 2)
  assert (again.compiled, again.loaded) == (1, 0)
  assert any(str(path) in r.getMessage() and "compiling it again" in r.getMessage()
             for r in caplog.records)  # fmt: skip
  again.close()
  repaired = executables.ExecutableCache(str(tmp_path))  # the file was written again, whole
  repaired("affine", AFFINE, x, w, power=2)
  assert (repaired.compiled, repaired.loaded) == (0, 1)
  assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


def test_programs_unused_for_a_month_are_pruned_when_a_program_is_saved(tmp_path):
  x, w = jnp.ones((2, 4)), jnp.ones((4, 2))
  executables.ExecutableCache(str(tmp_path))("affine", AFFINE, x, w, power=2)
  (kept,) = [tmp_path / f for f in _files(tmp_path)]
  stale = tmp_path / ("0" * 64 + executables.SUFFIX)
  stale.write_bytes(b"a program of an older version")
  month = time.time() - (executables.MAX_AGE_DAYS + 1) * 86400
  for path in (kept, stale):
    os.utime(path, (month, month))
  cache = executables.ExecutableCache(str(tmp_path))
  cache("affine", AFFINE, x, w, power=2)  # loaded: its file is used again
  assert kept.stat().st_mtime > month and stale.exists()  # nothing saved yet, nothing pruned
  cache("affine", AFFINE, x, w, power=3)  # compiled and saved: the stale file goes
  assert not stale.exists() and kept.exists() and len(_files(tmp_path)) == 2
  cache.close()


def test_it_refuses_to_run_beside_jax_persistent_compilation_cache(tmp_path):
  previous = jax.config.jax_compilation_cache_dir
  jax.config.update("jax_compilation_cache_dir", str(tmp_path / "jax"))
  try:
    with pytest.raises(errors.UserError, match="persistent compilation cache"):
      executables.ExecutableCache(str(tmp_path))
  finally:
    jax.config.update("jax_compilation_cache_dir", previous)


CONFIG = TransformerConfig(
    vocab_size=7, d_model=16, num_heads=2, num_layers=1, d_ff=32, max_len=16, deterministic=True
)


def test_a_predictor_loads_its_programs_and_translates_the_same(tmp_path):
  beam_size = 3
  # The batch is split over the 8 devices, as in translate; a second process (here a new
  # cache on the same directory) prefetches every program and traces nothing.
  params = random_params(CONFIG, seed=3)
  rng = np.random.default_rng(0)
  inputs = rng.integers(3, 7, size=(16, 6)).astype(np.int32)
  inputs[:, -1] = EOS_ID
  mesh = sharding.make_mesh({"data": -1})
  params = jax.device_put(params, sharding.replicated(mesh))
  inputs = jax.device_put(inputs, sharding.batch_sharding(mesh))
  with jax.set_mesh(mesh):
    plain = decode.Predictor(CONFIG, 5, beam_size, block=2, min_rows=8)
    expected = plain(params, inputs)

    first = decode.Predictor(
        CONFIG, 5, beam_size, block=2, min_rows=8,
        executables=executables.ExecutableCache(str(tmp_path)),
    )  # fmt: skip
    np.testing.assert_array_equal(first(params, inputs), expected)
    compiled = first.executables.compiled
    assert compiled == first.programs() >= 2 and first.executables.loaded == 0

    cache = executables.ExecutableCache(str(tmp_path))
    second = decode.Predictor(CONFIG, 5, beam_size, block=2, min_rows=8, executables=cache)
    np.testing.assert_array_equal(second(params, inputs), expected)
    assert (cache.loaded, cache.compiled, second.traces) == (compiled, 0, 0)
    cache.close()
