"""A checkpoint's files are what was saved, or every reader says it is damaged (runs/digest.py).

The record is tested against its definition (each file's size and zlib's CRC-32) and for being
written before the step commits; a tiny run's checkpoints are then damaged as a disk or a copy
would (bytes flipped in its data files, a file cut short or lost, values changed behind the
record's back, the data position edited) and each reader is checked: training's restore, the
parameters-only restore of the commands (translate, parse, tune_decoding, export, plot_attention
and Parser.load all load through `inference.load_run`), `average` and the averaged parameters.
Checkpoints written without a record still restore, with a note.
"""

import json
import shutil
import zlib

import jax
import jax.numpy as jnp
import pytest

from transformer_jax import average
from transformer_jax import config as config_lib
from transformer_jax.data import pipeline
from transformer_jax.runs import checkpoint, digest, inference
from transformer_jax.training import train


def test_the_record_is_each_files_size_and_crc32(tmp_path):
  (tmp_path / "item" / "d").mkdir(parents=True)
  contents = {"top": b"step metadata", "item/a": b"x" * 70_000, "item/d/b": bytes(range(256))}
  for name, data in contents.items():
    (tmp_path / name).write_bytes(data)
  expected = {k: [len(v), f"{zlib.crc32(v):08x}"] for k, v in contents.items()}
  assert digest.record_files(tmp_path) == expected
  items = {k: v for k, v in expected.items() if "/" in k}
  assert digest.record_files(tmp_path, subdirectories=True) == items
  digest.write(tmp_path, items)
  assert digest.record_files(tmp_path) == expected  # the record itself is never recorded
  assert digest.damaged(tmp_path, items) == []
  (tmp_path / "item" / "a").write_bytes(b"x" * 69_999 + b"y")
  (tmp_path / "item" / "d" / "b").unlink()
  assert digest.damaged(tmp_path, items) == ["item/a (other bytes)", "item/d/b (missing)"]
  (tmp_path / "item" / "a").write_bytes(b"x")
  assert digest.damaged(tmp_path, items)[0] == "item/a (1 bytes, 70000 written)"


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
  for step in (2, 3, 4):  # every step's items recorded as they are on disk
    step_dir = trained / "checkpoints" / str(step)
    record = json.loads((step_dir / digest.RECORD).read_text())
    assert record["files"] == digest.record_files(step_dir, subdirectories=True)
    assert "data/metadata" in record["files"]
    assert any(n.startswith("state/ocdbt.process_0/d/") for n in record["files"])


def test_a_step_is_committed_only_with_its_record(run_copy, monkeypatch):
  state, data = _restore_state(run_copy, 4)

  def fail(*args, **kwargs):
    raise OSError("disk full")

  monkeypatch.setattr(digest, "record_files", fail)
  with pytest.raises(OSError, match="disk full"):
    with checkpoint.make_manager(str(run_copy), keep=10, save_every=1) as manager:
      checkpoint.save(manager, 5, state, data, force=True)
      manager.wait_until_finished()
  assert not (run_copy / "checkpoints" / "5").exists()  # never committed


@pytest.mark.parametrize("damage", ["bytes flipped", "cut short", "lost"])
def test_damaged_checkpoint_bytes_are_named_by_every_reader(run_copy, damage):
  _, abstract = _abstract(run_copy)
  for f in _data_files(run_copy / "checkpoints" / "4" / "state"):
    if damage == "bytes flipped":
      _flip_bytes(f)
    elif damage == "cut short":
      f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    else:
      f.unlink()
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
  expected = r"step 4 .* is damaged: \d+ of its files differ .*other bytes"
  with pytest.raises(checkpoint.CheckpointError, match=expected):
    _restore_state(run_copy, 4)


def _resave_behind_the_digest(workdir, step, change):
  """Rewrites checkpoint `step` with `change(state)` and puts back the record of the files as
  first saved: the files hold other values than the record was taken of, as after damage."""
  state, data = _restore_state(workdir, step)
  step_dir = workdir / "checkpoints" / str(step)
  record = (step_dir / digest.RECORD).read_text()
  step_dir.rename(workdir / f"old_{step}")
  with checkpoint.make_manager(str(workdir), keep=10, save_every=1) as manager:
    checkpoint.save(manager, step, change(state), data, force=True)
    manager.wait_until_finished()
  (step_dir / digest.RECORD).write_text(record)


def _nudge(tree):
  """`tree` with one element of its first floating-point array changed."""
  leaves, treedef = jax.tree.flatten(tree)
  k = next(i for i, x in enumerate(leaves) if jnp.issubdtype(x.dtype, jnp.floating))
  leaves[k] = leaves[k].at[(0,) * leaves[k].ndim].add(1.0)
  return jax.tree.unflatten(treedef, leaves)


@pytest.mark.parametrize("part", ["opt_state", "params"])
def test_changed_values_are_named_by_every_reader(run_copy, part):
  _resave_behind_the_digest(run_copy, 4, lambda s: s.replace(**{part: _nudge(getattr(s, part))}))
  expected = r"step 4 .* is damaged: \d+ of its files differ from the digest"
  with pytest.raises(checkpoint.CheckpointError, match=expected):
    _restore_state(run_copy, 4)
  # The commands read all of the step's files before its parameters, moments included.
  with pytest.raises(checkpoint.CheckpointError, match=expected):
    inference.load_run(str(run_copy), "latest", beam_size=1)


def test_a_changed_data_position_is_named(run_copy):
  path = run_copy / "checkpoints" / "4" / "data" / "metadata"
  position = json.loads(path.read_text())
  position["train_seconds"] = position.get("train_seconds", 0) + 1000
  path.write_text(json.dumps(position))
  with pytest.raises(checkpoint.CheckpointError, match=r"is damaged: 1 of .*\(data/metadata \("):
    _restore_state(run_copy, 4)


@pytest.mark.parametrize("text", ['{"format": 2, "fi', '{"format": 2, "files": [1]}', "[]"])
def test_a_damaged_record_is_named(run_copy, text):
  (run_copy / "checkpoints" / "4" / digest.RECORD).write_text(text)
  expected = r"checkpoints/4/digest.json is damaged or cut short \(.*\): .*--checkpoint STEP"
  with pytest.raises(checkpoint.CheckpointError, match=expected):
    _restore_state(run_copy, 4)
  with pytest.raises(checkpoint.CheckpointError, match=expected):
    inference.load_run(str(run_copy), "latest", beam_size=1)


def test_damaged_averaged_parameters_are_named(run_copy):
  for f in _data_files(run_copy / checkpoint.AVERAGED_DIR / "params"):
    _flip_bytes(f)
  with pytest.raises(checkpoint.CheckpointError, match=r"averaged checkpoint .*(damaged|cannot)"):
    inference.load_run(str(run_copy), "avg", beam_size=1)
  (run_copy / checkpoint.AVERAGED_DIR / "steps.json").write_text('{"steps": [2')
  with pytest.raises(checkpoint.CheckpointError, match=r"steps.json is damaged or cut short"):
    inference.load_run(str(run_copy), "avg", beam_size=1)


def test_checkpoints_written_before_digests_load_with_a_note(run_copy, caplog):
  (run_copy / "checkpoints" / "4" / digest.RECORD).unlink()
  (run_copy / checkpoint.AVERAGED_DIR / "steps.json").write_text('{"steps": [3, 4]}')
  state, _ = _restore_state(run_copy, 4)
  assert int(state.step) == 4
  assert inference.load_run(str(run_copy), "latest", beam_size=1).checkpoint == "step 4"
  assert inference.load_run(str(run_copy), "avg", beam_size=1).checkpoint.startswith("average")
  notes = [r.getMessage() for r in caplog.records if "without a digest" in r.getMessage()]
  assert notes and all("\n" not in n for n in notes)
  assert any("checkpoint step 4" in n for n in notes) and any("averaged" in n for n in notes)
