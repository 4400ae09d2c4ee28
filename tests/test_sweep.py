"""Table 3 configs against the paper, d_k != d_v attention, and the sweep runner."""

import json
import pathlib
import subprocess
import sys

import flax.linen as nn
import jax
import numpy as np
import pytest
from testing import random_params

from configs import table3
from transformer_jax import config as config_lib
from transformer_jax import sweep
from transformer_jax.model.transformer import Transformer, TransformerConfig

REPO = pathlib.Path(__file__).resolve().parents[1]


def _num_params(model_config) -> int:
  dummy = np.ones((1, 4), np.int32)
  shapes = nn.unbox(jax.eval_shape(Transformer(model_config).init, jax.random.key(0), dummy, dummy))
  return sum(x.size for x in jax.tree.leaves(shapes["params"]))


@pytest.mark.slow  # 10-60 s on 2 cores: .ci/run runs it after the default suite
@pytest.mark.parametrize("row", list(table3.PAPER))
def test_table3_row_changes_only_its_own_values_and_has_the_papers_size(row):
  changes, _, _, paper_params = table3.PAPER[row]
  config, base = table3.get_config(row), table3.get_config("base")
  config_lib.validate(config)
  differ = {
      f"{section}.{key}"
      for section in ("model", "data", "train", "eval")
      for key in config[section]
      if config[section][key] != base[section][key]
  }
  assert differ == set(changes)
  model = config_lib.model_config(config, vocab_size=37000)  # §5.1's shared vocabulary
  # Rows (A) keep h * d_k = h * d_v = d_model: the same computation as the base model.
  if row.startswith("A"):
    assert model.num_heads * model.head_key_dim == model.num_heads * model.head_value_dim == 512
  if row == "B1":
    assert (model.head_key_dim, model.head_value_dim) == (16, 64)
  if row in ("C4", "C5"):
    assert model.head_key_dim == model.head_value_dim == model.d_model // 8
  if paper_params is None:
    return
  millions = _num_params(model) / 1e6
  if model.d_model == 512 and row != "base":
    # Same embedding as the base row: the change in size must be the paper's, to the rounding
    # of two figures to whole millions.
    base_millions = _num_params(config_lib.model_config(base, vocab_size=37000)) / 1e6
    assert millions - base_millions == pytest.approx(paper_params - 65, abs=1.0)
  else:
    # The totals run ~3% under the paper's (63.1M for base against 65M), in proportion to
    # d_model, as if its vocabulary ("about 37000", §5.1) were a few thousand larger.
    assert millions == pytest.approx(paper_params, rel=0.05)


def test_table3_uses_the_development_set_without_averaging():
  config = table3.get_config("C1")
  assert config.data.test_split == config.data.eval_split == "validation"  # newstest2013
  assert config.train.average_last == 0
  assert (config.eval.beam_size, config.eval.alpha) == (4, 0.6)
  with pytest.raises(ValueError, match="unknown Table 3 row 'F1'"):
    table3.get_config("F1")


def _find(tree, name):
  """The first subtree called `name` (depth-first)."""
  for key, value in tree.items():
    if key == name:
      return value
    if isinstance(value, dict) and (found := _find(value, name)) is not None:
      return found
  return None


def test_attention_with_smaller_key_size_matches_the_formula():
  """Row (B): d_k = 4 < d_v = 8. The layer equals softmax(Q K^T / sqrt(d_k)) V W^O, per head."""
  config = TransformerConfig(
      vocab_size=11,
      d_model=16,
      num_heads=2,
      key_dim=4,
      value_dim=8,
      num_layers=1,
      d_ff=32,
      deterministic=True,
  )
  params = random_params(config)
  attention = _find(params, "self_attention")
  assert attention["query"].shape == attention["key"].shape == (16, 2, 4)  # [e, h, d_k]
  assert attention["value"].shape == (16, 2, 8)  # [e, h, d_v]
  assert attention["out"].shape == (2, 8, 16)  # [h, d_v, e]

  from transformer_jax.model.attention import MultiHeadAttention

  x = np.random.default_rng(0).standard_normal((1, 5, 16)).astype(np.float32)
  out = MultiHeadAttention(config).apply({"params": attention}, x, x, None)
  q = np.einsum("qe,ehd->qhd", x[0], attention["query"])  # [5, h, 4]
  k = np.einsum("ke,ehd->khd", x[0], attention["key"])  # [5, h, 4]
  v = np.einsum("ke,ehd->khd", x[0], attention["value"])  # [5, h, 8]
  logits = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(4)
  weights = np.exp(logits - logits.max(-1, keepdims=True))
  weights /= weights.sum(-1, keepdims=True)
  heads = np.einsum("hqk,khd->qhd", weights, v)
  expected = np.einsum("qhd,hde->qe", heads, attention["out"])
  np.testing.assert_allclose(np.asarray(out[0]), expected, rtol=1e-5, atol=1e-5)


SWEEP_CONFIG = """
from testing import tiny_train_config

from transformer_jax import sweep

PAPER = {
    "one_layer": ({}, 9.0, 1.0, None),
    "narrow_ffn": ({"model.d_ff": 32}, 9.5, 0.5, None),
}


def get_config(row):
  config = tiny_train_config()
  config.train.num_steps = 4
  config.train.checkpoint_every = 2
  config.train.eval_every = 0
  sweep.apply_changes(config, PAPER[row][0])
  return config
"""


def _sweep(*args):
  env = {"PYTHONPATH": f"{REPO}:{REPO / 'tests'}", "PATH": "/usr/bin:/bin"}
  import os

  env = {**os.environ, **env}
  env["XLA_FLAGS"] = " ".join(  # one device, as a user's run (see test_quickstart_e2e)
      f for f in env.get("XLA_FLAGS", "").split() if "force_host_platform_device_count" not in f
  )
  return subprocess.run(
      [sys.executable, "-m", "transformer_jax.sweep", *args],
      capture_output=True,
      text=True,
      env=env,
      cwd=REPO,
      timeout=600,
  )


@pytest.mark.subprocess
def test_sweep_trains_each_row_skips_finished_ones_and_writes_the_table(tmp_path):
  config_file = tmp_path / "sweep_config.py"
  config_file.write_text(SWEEP_CONFIG)
  root = tmp_path / "sweep"
  args = [f"--config={config_file}", f"--workdir_root={root}", "--override=train.num_steps=2"]

  # A wrong row or override fails before anything trains.
  bad = _sweep(*args, "--rows=one_layer,two_layers")
  assert bad.returncode != 0 and "two_layers" in bad.stderr and not root.exists()
  bad = _sweep(*args, "--override=model.d_fff=3")
  assert bad.returncode != 0 and "d_fff" in bad.stderr and not root.exists()

  done = _sweep(*args)
  assert done.returncode == 0, done.stderr[-3000:]
  table = json.loads(done.stdout.strip().splitlines()[-1])["rows"]
  assert [r["row"] for r in table] == ["one_layer", "narrow_ffn"]
  for record in table:
    results = json.loads((root / record["row"] / "results.json").read_text())
    assert record["steps"] == results["step"] == 2  # the override reached every row
    assert record["ppl"] == round(results["eval_perplexity"], 2)
  assert table[1]["params"] < table[0]["params"]  # d_ff 32 < 64
  assert table[1]["changes"] == "d_ff=32" and table[1]["paper_ppl"] == 9.5
  markdown = (root / "table.md").read_text()
  assert "| narrow_ffn | d_ff=32 |" in markdown

  again = _sweep(*args)  # finished rows are skipped: nothing trains
  assert again.returncode == 0
  assert again.stderr.count("skipped") == 2
  assert "train.py" not in again.stderr.split("skipped")[-1]

  dry = _sweep(*args, "--dry_run", "--rows=narrow_ffn")
  assert dry.stdout.strip().endswith(f"--workdir={root / 'narrow_ffn'} --config.train.num_steps=2")


def test_override_parsing():
  assert sweep.parse_override("train.num_steps=20") == ("train.num_steps", 20)
  assert sweep.parse_override("model.positional=learned") == ("model.positional", "learned")
  with pytest.raises(ValueError, match="KEY=VALUE"):
    sweep.parse_override("train.num_steps")
  module = sweep.load_sweep(str(REPO / "configs" / "table3.py"))
  config = sweep.row_config(module, "B1", [("train.num_steps", 10)])
  assert config.train.num_steps == 10 and config.model.key_dim == 16
  with pytest.raises(config_lib.ConfigError, match="num_steps"):
    sweep.row_config(module, "B1", [("train.num_steps", "many")])
