"""Runs every test on the JAX CPU backend with 8 fake devices, so sharding is really exercised.

Both variables must be set before JAX is imported anywhere, hence here, at conftest import time.
"""

import os
import pathlib
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `configs` is imported as a package by config files
SHARED_DATA = REPO.parent / "shared" / "data"

# JAX's persistent compilation cache, for this test session only: many tests build the same tiny
# programs again (every `train.run` jits its own step functions), and a program compiled once is
# then loaded, not compiled. The same executable either way, so no result depends on it; the
# directory is removed when the session ends. Commands that set their own cache (translate's
# --compilation_cache) still override it.
_COMPILATION_CACHE = tempfile.mkdtemp(prefix="transformer_jax_tests_jax_cache_")
atexit.register(shutil.rmtree, _COMPILATION_CACHE, ignore_errors=True)
jax.config.update("jax_compilation_cache_dir", _COMPILATION_CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


@pytest.fixture
def shared_data() -> pathlib.Path:
  """../shared/data with the real corpora; tests that need it skip cleanly without it."""
  if not SHARED_DATA.is_dir():
    pytest.skip(f"{SHARED_DATA} is absent (real corpora are not shipped with the project)")
  return SHARED_DATA


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory):
  """(workdir, results) of a tiny translation run with checkpoints at steps 2, 3 and 4 and the
  average of 3 and 4, trained once for every module that reads one (tests copy it to change it).
  A module may define its own `trained_run`."""
  from test_train import tiny_config

  from transformer_jax.training import train

  workdir = tmp_path_factory.mktemp("run")
  config = tiny_config(num_steps=4, checkpoint_every=1, keep_checkpoints=3, average_last=2)
  config.eval.beam_size = 2
  results = train.run(config, str(workdir), devices=jax.devices()[:1])
  return workdir, results
