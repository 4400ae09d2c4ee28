"""saved_programs: a search run through exported programs translates exactly as the jitted one,
a later Predictor reads them back and traces nothing of the model or the search, anything that
changes a program's text gives it another file, and a damaged file or a cache that cannot be
written costs a call its tracing, never its output."""

import builtins
import contextlib
import dataclasses
import errno
import logging
import os
import shutil

import jax
import numpy as np
import pytest
from test_beam_search import CONFIG, EXTRA, tiny_model
from test_refill import BUCKETS, sources
from variants import MODELS, NaiveCache

from transformer_jax.decoding import compilation, decode, saved_programs
from transformer_jax.decoding.batch_shapes import Shapes


def _files(directory):
  return sorted(os.listdir(directory)) if os.path.isdir(directory) else []


def _predictor(beam_size, name="stock"):
  model = MODELS[name](CONFIG)  # the paper's model, or a variant (tests/variants.py)
  return decode.Predictor(model, EXTRA, beam_size, 0.6, Shapes(block=4))  # a start and a block


@pytest.fixture(
    scope="module",
    # One search in the default suite; greedy and the variant in .ci/run's slow stage.
    params=[
        pytest.param((1, "stock"), marks=pytest.mark.slow),
        (4, "stock"),
        pytest.param((4, "alibi"), marks=pytest.mark.slow),
    ],
    ids=lambda p: f"{p}",
)
def exported(request, tmp_path_factory):
  """(beam size, model name, the plain search's tokens, a cache directory where a first
  Predictor exported its programs, how many). Indirect parameters: a beam size (the stock
  model's) or (beam size, model name)."""
  beam_size, name = request.param if isinstance(request.param, tuple) else (request.param, "stock")
  params, inputs = tiny_model(name)
  expected = _predictor(beam_size, name).search(params, inputs)[0]
  cache = tmp_path_factory.mktemp("cache")
  first = _predictor(beam_size, name)
  saved = saved_programs.attach(first, str(cache))
  np.testing.assert_array_equal(first.search(params, inputs)[0], expected)
  assert first.programs() >= (2 if name == "stock" else 1) and saved.loaded == 0
  assert saved.exported == first.programs() == len(_files(cache / saved_programs.SUBDIR))
  return beam_size, name, expected, cache, first.programs()


def test_exported_programs_translate_the_same_and_a_later_run_traces_nothing(exported):
  beam_size, name, expected, cache, programs = exported
  params, inputs = tiny_model(name)
  later = _predictor(beam_size, name)
  saved = saved_programs.attach(later, str(cache))
  with compilation.CompileLog() as log:
    np.testing.assert_array_equal(later.search(params, inputs)[0], expected)
  assert saved.loaded == programs and saved.exported == 0
  assert log.traces["_start_impl"] == 0 and log.traces["_block_impl"] == 0  # nothing re-traced
  assert len(_files(cache / saved_programs.SUBDIR)) == programs


REFILL_PROGRAMS = ("_empty_impl", "_refill_impl", "_run_impl", "_keep_impl")


def _refilling():
  """A Predictor whose greedy search refills 4 rows 2 at a time (refill.py)."""
  predictor = decode.Predictor(CONFIG, EXTRA, refill=True)
  predictor.refiller = dataclasses.replace(
      predictor.refiller, rows=4, chunk=2, shapes=Shapes(min_rows=2)
  )
  return predictor


@pytest.mark.slow  # 5-10 s on 2 cores: .ci/run runs it after the default suite
def test_refilled_rows_run_exported_and_a_later_run_traces_nothing(tmp_path):
  """Greedy search in refilled rows keeps its programs as the batches' do: a later Predictor
  reads every one, traces none, and translates as the jitted search; a loaded program takes
  the carry it is given (donated, as to the jitted one), so a call copies no cache."""
  params, _ = tiny_model()
  batch = sources(37)
  search = lambda p: p.refiller.search(params, batch, BUCKETS, CONFIG.max_len)  # noqa: E731
  expected = search(_refilling())
  first = _refilling()
  saved = saved_programs.attach(first, str(tmp_path))
  with compilation.CompileLog() as log:
    assert all(np.array_equal(a, b) for a, b in zip(search(first), expected, strict=True))
  assert all(log.traces[name] > 0 for name in REFILL_PROGRAMS)  # the names traced
  programs = first.refiller.programs()
  assert saved.exported == programs == len(_files(tmp_path / saved_programs.SUBDIR))
  later = _refilling()
  saved = saved_programs.attach(later, str(tmp_path))
  with compilation.CompileLog() as log:
    assert all(np.array_equal(a, b) for a, b in zip(search(later), expected, strict=True))
  assert saved.loaded == programs and saved.exported == 0
  assert all(log.traces[name] == 0 for name in REFILL_PROGRAMS)
  assert later.refiller.programs() == programs
  columns = min(BUCKETS[-1] + EXTRA, CONFIG.max_len)
  carry = later.refiller._program("empty", rows=4, source=BUCKETS[-1], columns=columns)()
  later.refiller._program("run")(params, carry, np.int32(1))  # the search's own program
  assert saved.exported == 0 and all(x.is_deleted() for x in jax.tree.leaves(carry))


def _flip_middle(data: bytes, start: int = 0, end: int | None = None, size: int = 32) -> bytes:
  """`data` with `size` bytes in the middle of data[start:end] inverted: a disk error, an
  interrupted copy, two writers; the length is unchanged."""
  end = len(data) if end is None else end
  at = (start + end - size) // 2
  return data[:at] + bytes(b ^ 0xFF for b in data[at : at + size]) + data[at + size :]


def _payload(data: bytes) -> bytes:
  payload, problem = saved_programs.unpack(data)
  assert problem is None
  return payload


def _damaged_stablehlo(data: bytes) -> bytes:
  """A well-formed file (its digest matches) whose exported program jax.export deserializes,
  but whose StableHLO bytes are overwritten in the middle: it fails only when first called."""
  payload = _payload(data)
  module = jax.export.deserialize(bytearray(payload)).mlir_module_serialized
  at = payload.index(module)
  return saved_programs.pack(_flip_middle(payload, at, at + len(module), len(module) // 4))


DAMAGES = {  # how a kept file goes wrong -> (the damage, what the warning says)
    "bytes flipped": (_flip_middle, "do not match their sha256"),
    "truncated": (lambda data: data[: len(data) // 2], "do not match their sha256"),
    "truncated in its header": (lambda data: data[:16], "truncated header"),
    "the format before the digest": (_payload, "not a file of this format"),
    "another format version": (
        lambda data: data.replace(b"saved program v2", b"saved program v9", 1),
        "not a file of this format",
    ),
    "payload not jax.export's": (
        lambda data: saved_programs.pack(_flip_middle(_payload(data))[:64]),
        "jax.export cannot deserialize it",
    ),
    "StableHLO damaged": (_damaged_stablehlo, "its program failed when first called"),
}


@pytest.mark.parametrize("exported", [4], indirect=True)  # one search: this is about the files
@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_file_is_set_aside_and_exported_again(exported, damage, tmp_path, caplog):
  beam_size, _, expected, cache, programs = exported
  params, inputs = tiny_model()
  directory = tmp_path / saved_programs.SUBDIR
  shutil.copytree(cache / saved_programs.SUBDIR, directory)
  names = _files(directory)
  spoil, problem = DAMAGES[damage]
  for name in names:
    (directory / name).write_bytes(spoil((directory / name).read_bytes()))
  later = _predictor(beam_size)
  saved = saved_programs.attach(later, str(tmp_path))
  with caplog.at_level(logging.WARNING):
    np.testing.assert_array_equal(later.search(params, inputs)[0], expected)
  assert saved.loaded == 0 and saved.exported == len(names) == programs
  warnings = [r.getMessage() for r in caplog.records if "unreadable" in r.getMessage()]
  assert len(warnings) == len(names) and all(problem in w for w in warnings), warnings
  assert all(len(w.splitlines()) == 1 for w in warnings)
  for name in names:  # each named by its warning, set aside, and written again whole
    assert sum(str(directory / name) in w for w in warnings) == 1
    assert (directory / (name + saved_programs.SET_ASIDE)).exists()
    assert saved_programs.unpack((directory / name).read_bytes())[1] is None
  again = _predictor(beam_size)  # the cache is whole again: everything is read back
  saved = saved_programs.attach(again, str(tmp_path))
  np.testing.assert_array_equal(again.search(params, inputs)[0], expected)
  assert saved.loaded == programs and saved.exported == 0


@contextlib.contextmanager
def _read_only(directory, monkeypatch):
  """`directory` made read-only. Root ignores permission bits (CI runs as root), so for root
  the two ways this module writes there, opening a file to write and renaming, are refused as
  the operating system refuses them for a user."""
  os.chmod(directory, 0o555)
  try:
    if os.access(directory, os.W_OK):  # root
      inside = lambda path: os.path.dirname(os.path.abspath(path)) == str(directory)  # noqa: E731
      refused = lambda path: PermissionError(errno.EACCES, "Permission denied", str(path))  # noqa: E731
      real_open, real_replace = builtins.open, os.replace

      def open_(file, mode="r", *args, **kwargs):
        if inside(file) and any(c in mode for c in "wax+"):
          raise refused(file)
        return real_open(file, mode, *args, **kwargs)

      def replace(src, dst, *args, **kwargs):
        if inside(src) or inside(dst):
          raise refused(src)
        return real_replace(src, dst, *args, **kwargs)

      monkeypatch.setattr(builtins, "open", open_)
      monkeypatch.setattr(os, "replace", replace)
    yield
  finally:
    monkeypatch.undo()
    os.chmod(directory, 0o755)


@pytest.mark.parametrize("exported", [4], indirect=True)
def test_a_read_only_cache_is_read_and_its_damaged_files_cost_only_their_tracing(
    exported, tmp_path, monkeypatch, caplog
):
  beam_size, _, expected, cache, programs = exported
  params, inputs = tiny_model()
  directory = tmp_path / saved_programs.SUBDIR
  shutil.copytree(cache / saved_programs.SUBDIR, directory)
  names = _files(directory)
  with _read_only(directory, monkeypatch):  # whole files: all read back
    predictor = _predictor(beam_size)
    saved = saved_programs.attach(predictor, str(tmp_path))
    np.testing.assert_array_equal(predictor.search(params, inputs)[0], expected)
    assert saved.loaded == programs and saved.exported == 0
  damaged = names[0]
  (directory / damaged).write_bytes(_flip_middle((directory / damaged).read_bytes()))
  before = {n: (directory / n).read_bytes() for n in names}
  with _read_only(directory, monkeypatch), caplog.at_level(logging.WARNING):
    predictor = _predictor(beam_size)
    saved = saved_programs.attach(predictor, str(tmp_path))
    np.testing.assert_array_equal(predictor.search(params, inputs)[0], expected)
  assert saved.loaded == programs - 1 and saved.exported == 0
  messages = [r.getMessage() for r in caplog.records]
  assert (
      sum(f"{directory / damaged} unreadable" in m and "left in place" in m for m in messages) == 1
  )
  assert sum("could not keep" in m for m in messages) == 1
  assert {n: (directory / n).read_bytes() for n in _files(directory)} == before  # nothing written


@pytest.mark.parametrize("exported", [4], indirect=True)
def test_a_directory_that_cannot_be_written_costs_nothing_but_the_files(exported, tmp_path, caplog):
  beam_size, _, expected, _, programs = exported
  params, inputs = tiny_model()
  (tmp_path / saved_programs.SUBDIR).write_text("a file where the directory should be")
  predictor = _predictor(beam_size)
  saved = saved_programs.attach(predictor, str(tmp_path))
  with caplog.at_level(logging.WARNING):
    np.testing.assert_array_equal(predictor.search(params, inputs)[0], expected)
  assert saved.exported == saved.loaded == 0
  assert sum("could not keep" in r.getMessage() for r in caplog.records) == programs


@dataclasses.dataclass(frozen=True)
class Constraint:
  """A constraint keyed by its fields, as tree_constraint.TreeConstraint."""

  table: np.ndarray
  words: bool = False

  def __call__(self, log_probs, prefixes, limit, inputs):
    return log_probs + self.table


def test_what_changes_a_program_changes_its_identity(tmp_path):
  identity = lambda p: saved_programs.predictor_identity(p)  # noqa: E731
  base = decode.Predictor(CONFIG, EXTRA, 4, 0.6)
  assert identity(base) == identity(
      decode.Predictor(CONFIG, EXTRA, 1, 2.0, Shapes(block=5))
  )  # arguments
  assert identity(base) != identity(decode.Predictor(CONFIG, EXTRA + 1))
  assert identity(base) != identity(decode.Predictor(CONFIG.replace(d_ff=128), EXTRA))
  assert identity(base) != identity(decode.Predictor(CONFIG, EXTRA, 4, 0.6, stop="k_finished"))
  table = np.zeros(CONFIG.vocab_size, np.float32)
  constrained = lambda c: decode.Predictor(CONFIG, EXTRA, constraint=c)  # noqa: E731
  one = identity(constrained(Constraint(table)))
  assert one != identity(base) and one == identity(constrained(Constraint(table.copy())))
  assert one != identity(constrained(Constraint(table + 1)))
  assert one != identity(constrained(Constraint(table, words=True)))
  # A constraint that is not a dataclass cannot be keyed: its programs are not kept.
  opaque = constrained(lambda log_probs, prefixes, limit, inputs: log_probs)
  assert saved_programs.attach(opaque, str(tmp_path)) is None and opaque.saved is None
  assert saved_programs.attach(base, None) is None and base.saved is None  # no cache: none kept
  assert saved_programs.attach(base, "gs://bucket/jax_cache") is None and base.saved is None
  # The model's class, its attention's and its cache's, and the source that defines them.
  assert identity(base) != identity(decode.Predictor(MODELS["alibi"](CONFIG), EXTRA, 4, 0.6))
  assert identity(base) != identity(decode.Predictor(CONFIG, EXTRA, 4, 0.6, cache=NaiveCache))


VARIANT = """
from transformer_jax.model.attention import MultiHeadAttention


class Scaled(MultiHeadAttention):
  def bias(self, query_positions, key_positions):
    return None if self.kind != "causal" else SCALE * (query_positions[:, None, :, None] - 0.0)


SCALE = {scale}
"""


def test_a_variant_edited_outside_the_package_is_another_program(tmp_path, monkeypatch):
  """A variant defined in a file of its own (not this package's source): editing that file
  changes the identity its programs are kept under, so it is never served its old program."""
  import importlib

  from transformer_jax.model.transformer import Transformer

  monkeypatch.syspath_prepend(str(tmp_path))
  identities = []
  for scale in (0.5, 0.25):
    (tmp_path / "my_variant.py").write_text(VARIANT.format(scale=scale))
    module = importlib.import_module("my_variant")
    module = importlib.reload(module)
    model = Transformer(CONFIG, attention=module.Scaled)
    identities.append(saved_programs.predictor_identity(decode.Predictor(model, EXTRA)))
  assert identities[0] != identities[1] and "my_variant.Scaled" in identities[0]
