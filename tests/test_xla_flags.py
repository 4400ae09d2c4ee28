"""config.xla_flags: validated with the config, added to XLA_FLAGS before JAX starts, never over a
flag the user set, and accepted by the CPU backend (the default is a GPU flag)."""

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from transformer_jax import config as config_lib
from transformer_jax.parallel import xla_flags

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_parse_names_each_flag_and_rejects_what_is_not_one():
  assert xla_flags.parse(" --xla_a=1   --xla_b ") == [("xla_a", "--xla_a=1"), ("xla_b", "--xla_b")]
  assert xla_flags.parse("") == []
  with pytest.raises(ValueError, match="'xla_a=1' is not an XLA flag"):
    xla_flags.parse("--xla_b=2 xla_a=1")


def test_a_malformed_flag_fails_config_validation_naming_the_key():
  config = config_lib.default_config()
  config.xla_flags = "--xla_gpu_enable_triton_gemm=false -O3"
  with pytest.raises(config_lib.ConfigError, match=r"config.xla_flags=.*'-O3' is not an XLA flag"):
    config_lib.validate(config)


def _fresh_process(xla_flags_env: str, flags: str) -> dict:
  """Applies `flags` in a new interpreter (JAX not started), then starts the CPU backend."""
  script = textwrap.dedent(f"""
      import json, os
      from transformer_jax.parallel import xla_flags
      added = xla_flags.apply({flags!r})
      env = os.environ["XLA_FLAGS"]
      import jax
      print(json.dumps({{"added": added, "env": env, "devices": jax.device_count()}}))
  """)
  env = {**os.environ, "XLA_FLAGS": xla_flags_env, "JAX_PLATFORMS": "cpu"}
  out = subprocess.run(
      [sys.executable, "-c", script], env=env, cwd=REPO, capture_output=True, text=True, timeout=120
  )
  assert out.returncode == 0, out.stderr[-2000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.subprocess
def test_the_default_is_added_before_jax_starts_and_the_cpu_backend_accepts_it():
  default = config_lib.default_config().xla_flags
  result = _fresh_process("--xla_force_host_platform_device_count=3", default)
  assert result["added"] == [default] == ["--xla_gpu_enable_triton_gemm=false"]
  assert result["env"] == f"--xla_force_host_platform_device_count=3 {default}"
  assert result["devices"] == 3  # the user's flag still took effect


@pytest.mark.subprocess
def test_a_flag_the_user_set_wins_over_the_config():
  user = "--xla_gpu_enable_triton_gemm=true --xla_force_host_platform_device_count=2"
  config_flags = "--xla_gpu_enable_triton_gemm=false --xla_force_host_platform_device_count=5"
  result = _fresh_process(user, config_flags)
  assert result == {"added": [], "env": user, "devices": 2}


def test_a_second_call_adds_nothing_and_keeps_the_users_flags(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_cpu_b=2")
  assert xla_flags.apply("--xla_cpu_a=1 --xla_cpu_b=3") == ["--xla_cpu_a=1"]
  assert xla_flags.apply("--xla_cpu_a=1 --xla_cpu_b=3") == []
  assert os.environ["XLA_FLAGS"] == (
      "--xla_force_host_platform_device_count=8 --xla_cpu_b=2 --xla_cpu_a=1"
  )
