"""benchmarks/throughput.py runs end to end on the CPU and its analytic FLOP count (the MFU
numerator) agrees with XLA's own count of the compiled train step."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


def run_throughput(args: list[str]) -> dict:
  """benchmarks/throughput.py on one CPU device: its one JSON line."""
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
  out = subprocess.run(
      [sys.executable, "benchmarks/throughput.py", *args],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
  )  # fmt: skip
  assert out.returncode == 0, out.stderr[-3000:]
  lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
  assert len(lines) == 1
  return json.loads(lines[0])


@pytest.mark.subprocess
def test_throughput_prints_one_json_line_whose_flop_count_matches_xla():
  args = [
      "--config", "configs/quickstart.py",
      "--config.model.num_layers=2", "--config.model.d_model=64", "--config.model.num_heads=4",
      "--config.model.d_ff=256", "--config.data.vocab_size=512",
      "--batch_size=16", "--seq_len=24", "--steps=2", "--warmup=1",
      "--peak_n=512", "--peak_repeats=3", "--peak_chain=3",
  ]  # fmt: skip
  r = run_throughput(args)
  assert r["batch_shape"] == [16, 24, 24] and r["target_tokens_per_step"] == 16 * 24
  # The figures agree with each other: rates are per median step time, MFU is achieved / peak.
  step_s = r["step_time_s"]
  assert r["tokens_per_s"] == pytest.approx(r["target_tokens_per_step"] / step_s, rel=1e-3)
  assert r["achieved_flops_per_s"] == pytest.approx(r["flops_per_step"] / step_s, rel=1e-3)
  assert r["mfu"] == pytest.approx(r["achieved_flops_per_s"] / r["peak_flops"], abs=1e-4)
  # 512³ matmuls run near the CPU's matmul peak (256³ ones are dispatch-bound: a peak ~8x too
  # low); the step's matmuls are smaller (at most 384x64x512) and it does other work, so its MFU
  # is well below 1 (0.13-0.15 on 2 shared cores). Above 1, the FLOP count or a timing is wrong.
  assert 0 < r["mfu"] < 1.0
  assert r["peak_matmul"].endswith("3 back to back")
  # The processor by name and the cores (benchmarks/machine.py): "cpu" alone compares nothing.
  assert r["processor"] and r["processor"] != "cpu" and r["cpus"] >= 1
  # A CPU has no nominal peak in the table: no nominal MFU rather than a made-up one.
  assert r["nominal_peak_flops"] is None and r["mfu_nominal"] is None
  # XLA counts every FLOP of the step (softmax, LayerNorm, Adam too); the analytic count is
  # matmuls only, so it is a little lower, never higher (checks the formula's terms and factors).
  assert 0.8 < r["flops_per_step"] / r["xla_flops_per_step"] <= 1.0


@pytest.mark.subprocess
def test_throughput_times_the_first_batch_as_training_reads_it_packed(tmp_path):
  from test_pipeline import small_corpus

  small_corpus(tmp_path, num_pairs=600)
  args = [
      "--config", "configs/quickstart.py:smoke", "--config.data.source=text",
      f"--config.data.path={tmp_path}", "--config.data.vocab_size=120",
      f"--config.data.cache_dir={tmp_path / 'cache'}", "--config.data.packing=True",
      "--config.data.max_len=32", "--config.model.max_len=32", "--config.data.tokens_per_batch=256",
      "--steps=1", "--warmup=0", "--peak_n=256", "--peak_repeats=1",
  ]  # fmt: skip
  r = run_throughput(args)
  assert r["batch"] == "first training batch of data.source='text' (packed rows)"
  rows, source_len, target_len = r["batch_shape"]
  # Rows of max_len positions, each holding several pairs (3-11 words a side): far more real
  # target tokens than one pair per row could give, ~tokens_per_batch positions in all.
  assert source_len == target_len == 32 and rows == 256 // 32
  assert r["target_tokens_per_step"] > 0.8 * rows * 32


@pytest.mark.subprocess
def test_checkpoint_benchmark_times_saves_and_restores_with_and_without_the_digest():
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
  command = [sys.executable, "benchmarks/checkpoint.py", "--config", "configs/quickstart.py"]
  out = subprocess.run(
      [*command, "--vocab_size", "64", "--repeats", "1"],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
  )  # fmt: skip
  assert out.returncode == 0, out.stderr[-3000:]
  (line,) = [line for line in out.stdout.splitlines() if line.startswith("{")]
  result = json.loads(line)
  assert result["benchmark"] == "checkpoint" and result["parameters"] > 0
  assert result["state_bytes"] >= 4 * result["parameters"]  # float32 parameters and moments
  for key in ("save", "save_digest", "restore", "restore_verified", "digest"):
    assert result[f"{key}_s"] > 0 and len(result["all_s"][key]) == 1
  assert result["processor"] and result["cpus"] >= 1
