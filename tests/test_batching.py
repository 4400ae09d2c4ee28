"""Batching: layout of a batch, bucketing, coverage, exact resume, process sharding."""

import collections
import json

import numpy as np
import pytest

from transformer_jax.data.batching import (
    BatchIterator,
    eval_batches,
    make_bucket_lengths,
    padding_efficiency,
)
from transformer_jax.data.tokenizer import BOS_ID, EOS_ID, PAD_ID

BUCKETS = (8, 16, 24, 32)


def random_examples(n, seed=0, max_len=30):
  rng = np.random.default_rng(seed)
  return [
      (
          rng.integers(4, 100, size=rng.integers(0, max_len)).tolist(),
          rng.integers(4, 100, size=rng.integers(1, max_len)).tolist(),
      )
      for _ in range(n)
  ]


@pytest.fixture(scope="module")
def examples():
  return random_examples(1000)


def make_iterator(examples, **kwargs):
  defaults = dict(seed=1, bucket_lengths=BUCKETS)
  if "batch_size" not in kwargs:
    defaults["tokens_per_batch"] = 512
  return BatchIterator(examples, **(defaults | kwargs))


def content(row):
  """A row's tokens before the first PAD."""
  row = list(row)
  return row[: row.index(PAD_ID)] if PAD_ID in row else row


def test_make_bucket_lengths():
  assert make_bucket_lengths(64) == (8, 16, 24, 32, 40, 48, 56, 64)
  assert make_bucket_lengths(256) == (32, 64, 96, 128, 160, 192, 224, 256)
  assert make_bucket_lengths(100)[-1] == 100


def test_batch_layout():
  ex = [([10, 11, 12], [20, 21]), ([13], [22, 23, 24, 25])]
  batch = next(make_iterator(ex, batch_size=2, shuffle=False))
  assert set(batch) == {"inputs", "decoder_inputs", "targets"}
  for array in batch.values():
    assert array.dtype == np.int32 and array.shape == (2, 8)
  np.testing.assert_array_equal(
      batch["inputs"], [[10, 11, 12, EOS_ID, 0, 0, 0, 0], [13, EOS_ID, 0, 0, 0, 0, 0, 0]]
  )
  np.testing.assert_array_equal(
      batch["decoder_inputs"], [[BOS_ID, 20, 21, 0, 0, 0, 0, 0], [BOS_ID, 22, 23, 24, 25, 0, 0, 0]]
  )
  np.testing.assert_array_equal(
      batch["targets"], [[20, 21, EOS_ID, 0, 0, 0, 0, 0], [22, 23, 24, 25, EOS_ID, 0, 0, 0]]
  )


def test_decoder_inputs_are_targets_shifted_right(examples):
  it = make_iterator(examples)
  for _ in range(20):
    batch = next(it)
    targets, decoder_inputs = batch["targets"], batch["decoder_inputs"]
    np.testing.assert_array_equal(decoder_inputs[:, 0], BOS_ID)
    # Shifting drops the final EOS; everywhere else the two agree.
    shifted = np.where(targets[:, :-1] == EOS_ID, PAD_ID, targets[:, :-1])
    np.testing.assert_array_equal(decoder_inputs[:, 1:], shifted)
    # Exactly one EOS per row, right after the sentence.
    for row in (*batch["inputs"], *targets):
      assert content(row).count(EOS_ID) == 1 and content(row)[-1] == EOS_ID


def test_shapes_are_few_and_within_token_budget(examples):
  it = make_iterator(examples, batch_multiple=4)
  shapes = {next(it)["inputs"].shape for _ in range(it.batches_per_epoch)}
  assert len(shapes) <= len(BUCKETS)
  for rows, length in shapes:
    assert rows * length <= 512 and rows % 4 == 0
    assert it.rows_per_bucket[length] == rows
  assert it.rows_per_bucket == {8: 64, 16: 32, 24: 20, 32: 16}


def epoch_sources(it):
  seen = collections.Counter()
  for _ in range(it.batches_per_epoch):
    for row in next(it)["inputs"]:
      if row[0] != PAD_ID:
        seen[tuple(content(row)[:-1])] += 1
  return seen


def test_every_example_once_per_epoch(examples):
  want = collections.Counter(tuple(s) for s, _ in examples)
  it = make_iterator(examples, drop_remainder=False)
  assert epoch_sources(it) == want
  assert epoch_sources(it) == want  # The second epoch, shuffled differently.


def test_drop_remainder_drops_less_than_a_batch_per_bucket(examples):
  want = collections.Counter(tuple(s) for s, _ in examples)
  it = make_iterator(examples)
  seen = epoch_sources(it)
  assert all(count <= want[source] for source, count in seen.items())
  assert 0 <= len(examples) - sum(seen.values()) < sum(it.rows_per_bucket.values())


def test_epochs_are_shuffled_differently(examples):
  it = make_iterator(examples)
  first = [next(it)["inputs"] for _ in range(it.batches_per_epoch)]
  second = [next(it)["inputs"] for _ in range(it.batches_per_epoch)]
  assert any(a.shape != b.shape or (a != b).any() for a, b in zip(first, second))


@pytest.mark.parametrize("epochs, batches", [(0, 0), (0, 5), (1, 0), (2, 3)])
def test_exact_resume(examples, epochs, batches):
  # (1, 0): saved exactly at an epoch boundary.
  it = make_iterator(examples)
  for _ in range(epochs * it.batches_per_epoch + batches):
    next(it)
  state = json.loads(json.dumps(it.get_state()))  # What a checkpoint would store.
  restored = make_iterator(examples)
  restored.set_state(state)
  for _ in range(30):
    a, b = next(it), next(restored)
    for key in a:
      np.testing.assert_array_equal(a[key], b[key])


def test_resume_over_different_data_is_an_error(examples):
  state = make_iterator(examples).get_state()
  with pytest.raises(ValueError, match="examples"):
    make_iterator(examples[:-1]).set_state(state)


def test_process_slices_concatenate_to_the_global_batch(examples):
  whole = make_iterator(examples, batch_multiple=4)
  parts = [
      make_iterator(examples, batch_multiple=4, process_index=i, process_count=4) for i in range(4)
  ]
  for _ in range(25):
    batch = next(whole)
    slices = [next(p) for p in parts]
    for key in batch:
      np.testing.assert_array_equal(np.concatenate([s[key] for s in slices]), batch[key])


def test_truncation_keeps_room_for_eos_and_bos():
  ex = [(list(range(4, 50)), list(range(4, 9))), ([5], list(range(4, 60))), ([5], [6])]
  it = make_iterator(ex, batch_size=1, shuffle=False)
  assert it.num_truncated == 2
  batches = [next(it) for _ in range(3)]
  long_source = next(b for b in batches if b["inputs"][0, 0] == 4)
  assert long_source["inputs"].shape == (1, 32)
  assert long_source["inputs"][0, -1] == EOS_ID
  long_target = next(b for b in batches if b["targets"].shape[1] == 32 and b["inputs"][0, 0] == 5)
  assert long_target["targets"][0, -1] == EOS_ID
  assert long_target["decoder_inputs"][0, 0] == BOS_ID
  assert long_target["decoder_inputs"][0, -1] == 4 + 30


def test_eval_batches_cover_every_example_once_in_fixed_shapes(examples):
  batches = list(eval_batches(examples, batch_size=48, bucket_lengths=BUCKETS))
  shapes = {b["inputs"].shape for b in batches}
  assert len(shapes) <= len(BUCKETS) and all(rows == 48 for rows, _ in shapes)
  index = np.concatenate([b["index"] for b in batches])
  assert sorted(index[index >= 0].tolist()) == list(range(len(examples)))
  # Buckets share batches: as many batches as the rows need, filler rows only in the last one.
  assert len(batches) == -(-len(examples) // 48)
  assert all((b["index"] >= 0).all() for b in batches[:-1])
  # Each batch is padded to the smallest bucket that holds its longest pair.
  for batch in batches:
    real = batch["index"] >= 0
    longest = max(max(len(examples[i][0]), len(examples[i][1])) for i in batch["index"][real])
    length = batch["inputs"].shape[1]
    assert length == min(b for b in BUCKETS if b >= longest + 1)
  for batch in batches:
    for i, src_row, tgt_row in zip(batch["index"], batch["inputs"], batch["targets"]):
      if i < 0:
        assert (src_row == PAD_ID).all() and (tgt_row == PAD_ID).all()
      else:
        assert content(src_row) == examples[i][0] + [EOS_ID]
        assert content(tgt_row) == examples[i][1] + [EOS_ID]


def test_padding_efficiency_by_hand():
  batch = {
      "inputs": np.array([[5, 1, 0, 0], [5, 6, 7, 1]]),  # 6 real of 8
      "targets": np.array([[8, 1, 0, 0], [0, 0, 0, 0]]),
  }  # 2 real of 8
  assert padding_efficiency(batch) == 8 / 16


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(tokens_per_batch=20), "tokens_per_batch=20"),
        (dict(tokens_per_batch=256, batch_multiple=16), "tokens_per_batch=256"),
        (dict(tokens_per_batch=None), "exactly one of"),
        (dict(tokens_per_batch=512, batch_size=16), "exactly one of"),
        (dict(batch_size=6, batch_multiple=4), "batch_size=6"),
        (dict(batch_multiple=2, process_count=4), "process_count=4"),
        (dict(process_index=2, process_count=2), "process_index=2"),
        (dict(bucket_lengths=(16, 8)), "bucket_lengths"),
    ],
)
def test_bad_arguments_are_named(examples, kwargs, match):
  with pytest.raises(ValueError, match=match):
    make_iterator(examples, **kwargs)


def test_bad_examples_are_named():
  with pytest.raises(ValueError, match="empty"):
    make_iterator([])
  with pytest.raises(ValueError, match="target ids of example 1"):
    make_iterator([([5], [6]), ([5], [6, EOS_ID])])
  with pytest.raises(ValueError, match="No full batch"):
    make_iterator([([5], [6])], batch_size=4)


def test_an_epoch_of_30k_pairs_keeps_every_batch_within_its_token_budget():
  # numpy arrays, not lists: the other accepted input type, and quick to make. (Its speed is
  # benchmarks/pipeline.py's figure.)
  rng = np.random.default_rng(0)
  src_lens, tgt_lens = rng.integers(1, 60, size=(2, 30_000))
  sources = np.split(rng.integers(4, 100, size=src_lens.sum()), np.cumsum(src_lens)[:-1])
  targets = np.split(rng.integers(4, 100, size=tgt_lens.sum()), np.cumsum(tgt_lens)[:-1])
  ex = list(zip(sources, targets))
  it = BatchIterator(ex, seed=0, bucket_lengths=make_bucket_lengths(64), tokens_per_batch=4096)
  sentences = 0
  for _ in range(it.batches_per_epoch):
    batch = next(it)
    assert batch["inputs"].size <= 4096
    sentences += int(np.sum(batch["inputs"][:, 0] != PAD_ID))
  assert 0.95 * len(ex) <= sentences <= len(ex)


# ----------------------------------------------------------------------------- packing


def unpack(batch):
  """{(row, segment): (source ids, decoder inputs, target ids, source positions, target positions)}
  read back from a packed batch, checking on the way that each segment is one contiguous run."""
  out = {}
  for r in range(batch["inputs"].shape[0]):
    for side in ("inputs", "targets"):
      seg = batch[f"{side}_segmentation"][r]
      nonzero = seg[seg > 0]
      assert (np.diff(nonzero) >= 0).all() and (seg[len(nonzero) :] == 0).all()  # runs, in order
      assert ((batch[side][r] == PAD_ID) == (seg == 0)).all()
    for s in np.unique(batch["inputs_segmentation"][r]):
      if s == 0:
        continue
      src = batch["inputs_segmentation"][r] == s
      tgt = batch["targets_segmentation"][r] == s
      out[(r, int(s))] = (
          batch["inputs"][r][src],
          batch["decoder_inputs"][r][tgt],
          batch["targets"][r][tgt],
          batch["inputs_positions"][r][src],
          batch["targets_positions"][r][tgt],
      )
  return out


def test_packed_rows_hold_whole_pairs_with_restarting_positions(examples):
  it = make_iterator(examples, packing=True, tokens_per_batch=128)
  assert it.rows_per_bucket == {32: 4}
  by_source = collections.defaultdict(list)  # several pairs have an empty source
  for s, t in examples:
    by_source[tuple(s)].append(t[:31])
  num_segments = 0
  for _ in range(it.batches_per_epoch):
    batch = next(it)
    assert batch["inputs"].shape == batch["inputs_positions"].shape == (4, 32)
    segments = unpack(batch)
    num_segments += len(segments)
    for src, dec, tgt, src_pos, tgt_pos in segments.values():
      assert src[-1] == EOS_ID and tgt[-1] == EOS_ID and dec[0] == BOS_ID
      np.testing.assert_array_equal(dec[1:], tgt[:-1])  # shifted right within the pair (§3.1)
      np.testing.assert_array_equal(src_pos, np.arange(len(src)))
      np.testing.assert_array_equal(tgt_pos, np.arange(len(tgt)))
      assert list(tgt[:-1]) in by_source[tuple(src[:-1])]  # a whole pair, truncated at 31
  assert num_segments > 1.5 * 4 * it.batches_per_epoch  # several pairs a row


def test_packed_source_rows_may_be_shorter_than_target_rows():
  # Targets ~3 times their sources, as linearized trees are: source rows of 16, target rows of 32.
  rng = np.random.default_rng(3)
  examples = []
  for _ in range(400):
    n = int(rng.integers(1, 9))
    examples.append((rng.integers(4, 100, n).tolist(), rng.integers(4, 100, 3 * n + 1).tolist()))
  examples.append(([5] * 20, [6] * 20))  # a source longer than its rows: truncated to 15 + EOS
  it = make_iterator(
      examples, packing=True, tokens_per_batch=128, packed_source_len=16, drop_remainder=False
  )
  assert it.num_truncated == 1
  by_source = collections.defaultdict(list)  # short sources repeat
  for s, t in examples:
    by_source[tuple(s[:15])].append(t[:31])
  seen, target_fill = 0, []
  for _ in range(it.batches_per_epoch):
    batch = next(it)
    for key in ("inputs", "inputs_positions", "inputs_segmentation"):
      assert batch[key].shape == (4, 16)
    for key in ("targets", "decoder_inputs", "targets_positions", "targets_segmentation"):
      assert batch[key].shape == (4, 32)
    target_fill.append(np.mean(batch["targets_segmentation"] > 0))
    for src, dec, tgt, src_pos, tgt_pos in unpack(batch).values():
      seen += 1
      assert src[-1] == EOS_ID and tgt[-1] == EOS_ID and dec[0] == BOS_ID
      np.testing.assert_array_equal(src_pos, np.arange(len(src)))
      np.testing.assert_array_equal(tgt_pos, np.arange(len(tgt)))
      assert list(tgt[:-1]) in by_source[tuple(src[:-1].tolist())]  # a whole pair
  assert seen == len(examples)
  assert np.mean(target_fill) > 0.8  # the short source rows do not starve the target rows
  # A resume must draw the same batches: a changed source row length is refused.
  state = json.loads(json.dumps(it.get_state()))
  with pytest.raises(ValueError, match="packed_source_len=16, this run 0"):
    make_iterator(examples, packing=True, tokens_per_batch=128).set_state(state)
  with pytest.raises(ValueError, match="needs packing=True"):
    make_iterator(examples, tokens_per_batch=128, packed_source_len=16)
  with pytest.raises(ValueError, match=r"must be in \[2, max_len=32\]"):
    make_iterator(examples, packing=True, tokens_per_batch=128, packed_source_len=33)


def test_packing_places_every_pair_once_per_epoch(examples):
  want = collections.Counter(tuple(s) for s, _ in examples)
  it = make_iterator(examples, packing=True, tokens_per_batch=128, drop_remainder=False)
  for _ in range(2):  # two epochs, packed differently
    seen = collections.Counter()
    for _ in range(it.batches_per_epoch):
      for src, *_ in unpack(next(it)).values():
        seen[tuple(src[:-1].tolist())] += 1
    assert seen == want
  dropped = make_iterator(examples, packing=True, tokens_per_batch=128)
  kept = sum(len(unpack(next(dropped))) for _ in range(dropped.batches_per_epoch))
  assert 0 <= len(examples) - kept < 4 * 32  # less than one batch of rows dropped


def test_packing_has_little_padding_resumes_exactly_and_slices_by_process():
  examples = random_examples(1000, max_len=10)  # several pairs fit a row of 32
  it = make_iterator(examples, packing=True, tokens_per_batch=256, batch_multiple=4)
  real = np.mean([padding_efficiency(next(it)) for _ in range(it.batches_per_epoch)])
  buckets = make_iterator(examples, tokens_per_batch=256, batch_multiple=4)
  bucketed = np.mean([padding_efficiency(next(buckets)) for _ in range(buckets.batches_per_epoch)])
  assert real > 0.9 > bucketed
  for _ in range(3):
    next(it)
  restored = make_iterator(examples, packing=True, tokens_per_batch=256, batch_multiple=4)
  restored.set_state(json.loads(json.dumps(it.get_state())))
  parts = [
      make_iterator(
          examples,
          packing=True,
          tokens_per_batch=256,
          batch_multiple=4,
          process_index=i,
          process_count=2,
      )
      for i in range(2)
  ]
  for p in parts:
    p.set_state(it.get_state())
  for _ in range(2 * it.batches_per_epoch):
    a, b, slices = next(it), next(restored), [next(p) for p in parts]
    for key in a:
      np.testing.assert_array_equal(a[key], b[key])
      np.testing.assert_array_equal(np.concatenate([s[key] for s in slices]), a[key])


@pytest.mark.parametrize("packing", [False, True])
def test_resume_on_another_device_count_draws_the_same_global_batches(examples, packing):
  # 4 devices round rows down to a multiple of 4; one device alone would not round at all.
  kwargs = {"tokens_per_batch": 500, "packing": packing}
  saved = make_iterator(examples, batch_multiple=4, **kwargs)
  for _ in range(saved.batches_per_epoch + 2):
    next(saved)
  state = json.loads(json.dumps(saved.get_state()))
  alone = make_iterator(examples, batch_multiple=1, **kwargs)
  assert alone.rows_per_bucket != saved.rows_per_bucket  # the rounding differs
  two_processes = [
      make_iterator(examples, batch_multiple=2, process_index=i, process_count=2, **kwargs)
      for i in range(2)
  ]
  for it in (alone, *two_processes):
    it.set_state(state)
    assert it.rows_per_bucket == saved.rows_per_bucket
  for _ in range(saved.batches_per_epoch + 5):
    want, got = next(saved), next(alone)
    halves = [next(p) for p in two_processes]
    for key in want:
      np.testing.assert_array_equal(got[key], want[key])
      np.testing.assert_array_equal(np.concatenate([h[key] for h in halves]), want[key])
  with pytest.raises(ValueError, match=r"multiple of batch_multiple=8"):
    make_iterator(examples, batch_multiple=8, **kwargs).set_state(state)


def test_packing_in_parts_covers_every_pair_and_resumes_inside_a_part(examples, monkeypatch):
  from transformer_jax.data import batching

  monkeypatch.setattr(batching, "_PACK_PART", 150)  # 7 parts, the last one partial
  want = collections.Counter(tuple(s) for s, _ in examples)
  it = make_iterator(examples, packing=True, tokens_per_batch=128, drop_remainder=False)
  seen = collections.Counter()
  for _ in range(it.batches_per_epoch):
    for src, *_ in unpack(next(it)).values():
      seen[tuple(src[:-1].tolist())] += 1
  assert seen == want and it.get_state()["epoch"] == 0 and it.get_state()["part"] == 6
  for _ in range(it.batches_per_epoch // 2):  # into the next epoch's fourth part or so
    next(it)
  state = json.loads(json.dumps(it.get_state()))
  assert state["epoch"] == 1 and 0 < state["part"] < 6
  restored = make_iterator(examples, packing=True, tokens_per_batch=128, drop_remainder=False)
  restored.set_state(state)
  for _ in range(it.batches_per_epoch):
    a, b = next(it), next(restored)
    for key in a:
      np.testing.assert_array_equal(a[key], b[key])


def with_features(examples, width=3):
  """The examples with each source token's id followed by `width - 1` features derived from it
  (id + 1000 * k), so that a batch shows which token a feature row came with."""
  out = []
  for s, t in examples:
    ids = np.asarray(s, np.int32).reshape(-1)  # [n]
    feats = [ids + 1000 * k for k in range(1, width)]
    out.append((np.stack([ids, *feats], axis=-1).reshape(len(ids), width), t))  # [n, width]
  return out


def check_features_follow_their_ids(inputs, width):
  """inputs [B, L, width]: each real token's features are its own; EOS and PAD have none."""
  ids = inputs[..., 0]
  real = (ids != PAD_ID) & (ids != EOS_ID)
  for k in range(1, width):
    np.testing.assert_array_equal(inputs[..., k], np.where(real, ids + 1000 * k, 0))


@pytest.mark.parametrize("packing", [False, True])
def test_sources_with_features_batch_as_their_ids_do(examples, packing):
  """Sources given as [n, 1 + C] arrays (a token's columns, batching.py): the same batches as the
  ids alone, with inputs [B, L, 1 + C] whose first column is the ids' inputs and whose features
  go with their tokens (none on EOS and PAD); the other keys are unchanged."""
  kwargs = dict(packing=packing, tokens_per_batch=256 if packing else 512)
  plain, featured = make_iterator(examples, **kwargs), make_iterator(
      with_features(examples), **kwargs
  )
  for _ in range(plain.batches_per_epoch):
    a, b = next(plain), next(featured)
    assert b["inputs"].shape == a["inputs"].shape + (3,) and b.keys() == a.keys()
    np.testing.assert_array_equal(b["inputs"][..., 0], a["inputs"])
    check_features_follow_their_ids(b["inputs"], 3)
    for key in a.keys() - {"inputs"}:
      np.testing.assert_array_equal(b[key], a[key])
    assert padding_efficiency(b) == padding_efficiency(a)
  evaluated = list(eval_batches(with_features(examples[:50]), 8, BUCKETS))
  for a, b in zip(eval_batches(examples[:50], 8, BUCKETS), evaluated, strict=True):
    np.testing.assert_array_equal(b["inputs"][..., 0], a["inputs"])
    check_features_follow_their_ids(b["inputs"], 3)


def test_sources_of_mixed_widths_are_refused(examples):
  mixed = with_features(examples[:5]) + examples[5:10]
  with pytest.raises(ValueError, match="mix token ids"):
    make_iterator(mixed)
  bad = with_features(examples[:5])
  bad[2] = (np.zeros((3, 3), np.int32), bad[2][1])  # PAD ids, in the first column
  with pytest.raises(ValueError, match="source ids of example 2 contain 0"):
    make_iterator(bad)
