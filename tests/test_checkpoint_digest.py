"""A checkpoint's values are what was saved, or every reader says it is damaged (runs/digest.py).

The digest is tested against its formula and for independence from sharding; a tiny run's
checkpoints are then damaged as a disk or a copy would (bytes flipped in its data files, a file
cut short, one array changed behind the digest's back, the data position edited) and each reader
is checked: training's restore, the parameters-only restore of the commands (translate, parse,
tune_decoding, export, plot_attention and Parser.load all load through `inference.load_run`),
`average` and the averaged parameters. Checkpoints written before digests (no `digest` item)
still restore, with a note.
"""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from transformer_jax import average
from transformer_jax import config as config_lib
from transformer_jax.data import pipeline
from transformer_jax.runs import checkpoint, digest, inference
from transformer_jax.training import train


def _formula(x: np.ndarray) -> tuple[int, int]:
  """The module docstring's two sums, in Python integers modulo 2**32."""
  words = x.reshape(-1).view(np.uint32).astype(np.uint64)
  mask = 2**32 - 1
  weighted = mixed = 0
  for i, w in enumerate(int(v) for v in words):
    weighted = (weighted + w * (2 * i + 1)) & mask
    h = w ^ ((i * 0x9E3779B9) & mask)
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & mask
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & mask
    h ^= h >> 16
    mixed = (mixed + h) & mask
  return weighted, mixed


def test_the_digest_is_its_formula_and_the_same_on_any_sharding():
  x = np.random.default_rng(0).standard_normal((8, 6)).astype(np.float32)
  weighted, mixed = _formula(x)
  assert digest.tree_digest({"x": x}) == {"x": f"float32[8, 6]:{weighted:08x}{mixed:08x}"}
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("a", "b"))
  sharded = jax.device_put(x, NamedSharding(mesh, PartitionSpec("a", "b")))
  assert len(sharded.addressable_shards) == 8
  assert digest.tree_digest({"x": sharded}) == digest.tree_digest({"x": x})


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32, jnp.int8, jnp.bool_])
def test_any_changed_element_changes_the_digest(dtype):
  x = (jnp.arange(24).reshape(2, 3, 4) % 7).astype(dtype)
  before = digest.tree_digest({"x": x})["x"]
  for index in [(0, 0, 0), (1, 2, 3), (0, 1, 2)]:
    changed = x.at[index].set(jnp.asarray(1, dtype) if x[index] == 0 else jnp.asarray(0, dtype))
    assert digest.tree_digest({"x": changed})["x"] != before, index
  # Two different elements swapped: the same values at other positions.
  swapped = x.at[0, 0, 0].set(x[0, 0, 1]).at[0, 0, 1].set(x[0, 0, 0])
  assert digest.tree_digest({"x": swapped})["x"] != before


def test_leaf_names_come_from_the_keys_not_from_how_a_path_prints():
  tree = {"params": {"dense": [jnp.zeros(2), jnp.ones(3)]}}
  assert list(digest.tree_digest(tree)) == ["params/dense/0", "params/dense/1"]
  state = train.TrainState(step=jnp.int32(1), params={"w": jnp.zeros(2)}, opt_state=())
  assert list(digest.tree_digest(state)) == ["step", "params/w"]


@pytest.fixture(scope="module")
def trained(trained_run):
  """conftest's tiny run: checkpoints at steps 2, 3 and 4, the average of 3 and 4."""
  return trained_run[0]


@pytest.fixture
def run_copy(trained, tmp_path):
  copy = tmp_path / "run"
  shutil.copytree(trained, copy)
  return copy


def _data_files(directory):
  files = sorted(f for f in directory.rglob("*") if f.is_file() and f.parent.name == "d")
  assert files, f"no data files under {directory}"
  return files


def _flip_bytes(path, every=97):
  """One byte in `every` flipped, through the whole file: where Orbax puts the parameters among
  the moments varies from save to save, so a few flips could miss them (and then, rightly, the
  parameters restore)."""
  data = bytearray(path.read_bytes())
  for k in range(every // 2, len(data), every):
    data[k] ^= 0x5A
  path.write_bytes(bytes(data))


def _abstract(workdir):
  run = inference.load_run(str(workdir), "latest", beam_size=1)
  return run, jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), run.params
  )


def _restore_state(workdir, step):
  """(state, data position) of checkpoint `step`, restored as a resumed training run does."""
  config = inference.load_config(str(workdir))
  tokenizer = pipeline.load_workdir_tokenizer(str(workdir))
  trainer = train.Trainer(
      config, config_lib.model_config(config, tokenizer.vocab_size), devices=jax.devices()[:1]
  )
  with checkpoint.make_manager(str(workdir), keep=10, save_every=1) as manager:
    return checkpoint.restore(manager, trainer.abstract_state(), step)


def test_an_intact_run_restores_verified_with_no_note(trained, caplog):
  state, data = _restore_state(trained, 4)
  assert int(state.step) == 4 and data
  assert inference.load_run(str(trained), "avg", beam_size=1).checkpoint.startswith("average")
  assert "without a digest" not in caplog.text


@pytest.mark.parametrize("damage", ["bytes flipped", "cut short"])
def test_damaged_checkpoint_bytes_are_named_by_every_reader(run_copy, damage):
  _, abstract = _abstract(run_copy)
  for f in _data_files(run_copy / "checkpoints" / "4" / "state"):
    if damage == "bytes flipped":
      _flip_bytes(f)
    else:
      f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
  expected = r"checkpoint step 4 .*(is damaged|cannot be restored)"
  with pytest.raises(checkpoint.CheckpointError, match=expected) as raised:
    inference.restore_params(str(run_copy), 4, abstract)  # the commands' restore
  assert "\n" not in str(raised.value)
  with pytest.raises(checkpoint.CheckpointError, match=expected):
    inference.load_run(str(run_copy), "latest", beam_size=1)  # translate, parse, export, ...
  with pytest.raises(checkpoint.CheckpointError, match=expected):
    average.average_workdir(str(run_copy), 3)  # python -m transformer_jax.average
  with pytest.raises(checkpoint.CheckpointError, match=expected):
    _restore_state(run_copy, 4)  # a resumed training run (then set aside: test_train.py)
  # The other checkpoint is intact and still loads.
  assert inference.load_run(str(run_copy), "2", beam_size=1).checkpoint == "step 2"


def test_bytes_orbax_reads_without_complaint_are_caught_by_the_digest(run_copy):
  # One byte in the middle of each array data file (not the b-tree files beside them, which
  # carry a CRC of their own): chunk bytes that TensorStore decodes as other numbers, with no
  # error of its own.
  for f in _data_files(run_copy / "checkpoints" / "4" / "state"):
    if not f.parent.parent.name.startswith("ocdbt.process_"):
      continue
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x5A
    f.write_bytes(bytes(data))
  with pytest.raises(checkpoint.CheckpointError, match=r"step 4 .* is damaged: \d+ saved arrays"):
    _restore_state(run_copy, 4)


def _resave_behind_the_digest(workdir, step, change):
  """Rewrites checkpoint `step` with `change(state)` but the digest of the state as saved: the
  files hold other values than the ones the digest was taken of, as after silent damage."""
  state, data = _restore_state(workdir, step)
  original = digest.tree_digest(state)
  changed = change(state)
  (workdir / "checkpoints" / str(step)).rename(workdir / f"old_{step}")
  with checkpoint.make_manager(str(workdir), keep=10, save_every=1) as manager:
    real = digest.tree_digest
    digest.tree_digest = lambda tree: original
    try:
      checkpoint.save(manager, step, changed, data, force=True)
      manager.wait_until_finished()
    finally:
      digest.tree_digest = real


def _nudge(tree):
  """`tree` with one element of its first floating-point array changed."""
  leaves, treedef = jax.tree.flatten(tree)
  k = next(i for i, x in enumerate(leaves) if jnp.issubdtype(x.dtype, jnp.floating))
  leaves[k] = leaves[k].at[(0,) * leaves[k].ndim].add(1.0)
  return jax.tree.unflatten(treedef, leaves)


def test_a_changed_optimizer_moment_is_named_and_the_parameters_still_load(run_copy):
  _resave_behind_the_digest(run_copy, 4, lambda s: s.replace(opt_state=_nudge(s.opt_state)))
  with pytest.raises(checkpoint.CheckpointError, match=r"is damaged: 1 saved arrays .*opt_state/"):
    _restore_state(run_copy, 4)
  # The commands read the parameters only, and those are intact.
  assert inference.load_run(str(run_copy), "latest", beam_size=1).checkpoint == "step 4"


def test_a_changed_parameter_is_named(run_copy):
  _resave_behind_the_digest(run_copy, 4, lambda s: s.replace(params=_nudge(s.params)))
  with pytest.raises(checkpoint.CheckpointError, match=r"is damaged: 1 saved arrays .*\(params/"):
    inference.load_run(str(run_copy), "latest", beam_size=1)
  with pytest.raises(checkpoint.CheckpointError, match=r"is damaged: 1 saved arrays .*\(params/"):
    _restore_state(run_copy, 4)


def test_a_changed_data_position_is_named(run_copy):
  path = run_copy / "checkpoints" / "4" / "data" / "metadata"
  position = json.loads(path.read_text())
  position["train_seconds"] = position.get("train_seconds", 0) + 1000
  path.write_text(json.dumps(position))
  with pytest.raises(checkpoint.CheckpointError, match="data position differs"):
    _restore_state(run_copy, 4)


def test_damaged_averaged_parameters_are_named(run_copy):
  for f in _data_files(run_copy / checkpoint.AVERAGED_DIR / "params"):
    _flip_bytes(f)
  with pytest.raises(checkpoint.CheckpointError, match=r"averaged checkpoint .*(damaged|cannot)"):
    inference.load_run(str(run_copy), "avg", beam_size=1)
  (run_copy / checkpoint.AVERAGED_DIR / "steps.json").write_text('{"steps": [2')
  with pytest.raises(checkpoint.CheckpointError, match=r"steps.json is damaged or cut short"):
    inference.load_run(str(run_copy), "avg", beam_size=1)


def test_checkpoints_written_before_digests_load_with_a_note(run_copy, caplog):
  shutil.rmtree(run_copy / "checkpoints" / "4" / checkpoint.DIGEST_ITEM)
  (run_copy / checkpoint.AVERAGED_DIR / "steps.json").write_text('{"steps": [3, 4]}')
  state, _ = _restore_state(run_copy, 4)
  assert int(state.step) == 4
  assert inference.load_run(str(run_copy), "latest", beam_size=1).checkpoint == "step 4"
  assert inference.load_run(str(run_copy), "avg", beam_size=1).checkpoint.startswith("average")
  notes = [r.getMessage() for r in caplog.records if "without a digest" in r.getMessage()]
  assert notes and all("\n" not in n for n in notes)
  assert any("checkpoint step 4" in n for n in notes) and any("averaged" in n for n in notes)
