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

import pytest  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `configs` is imported as a package by config files
SHARED_DATA = REPO.parent / "shared" / "data"


@pytest.fixture
def shared_data() -> pathlib.Path:
  """../shared/data with the real corpora; tests that need it skip cleanly without it."""
  if not SHARED_DATA.is_dir():
    pytest.skip(f"{SHARED_DATA} is absent (real corpora are not shipped with the project)")
  return SHARED_DATA
