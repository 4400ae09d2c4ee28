"""saved_programs: a search run through exported programs translates exactly as the jitted one,
a later Predictor reads them back and traces nothing of the model or the search, and anything
that changes a program's text gives it another file."""

import dataclasses
import logging
import os
import shutil

import numpy as np
import pytest
from test_beam_search import CONFIG, EXTRA, tiny_model

from transformer_jax import compilation, decode, saved_programs
from transformer_jax.batch_shapes import Shapes


def _files(directory):
  return sorted(os.listdir(directory)) if os.path.isdir(directory) else []


def _predictor(beam_size):
  return decode.Predictor(CONFIG, EXTRA, beam_size, 0.6, Shapes(block=4))  # a start and a block


@pytest.fixture(scope="module", params=[1, 4], ids=["greedy", "beam4"])
def exported(request, tmp_path_factory):
  """(beam size, the plain search's tokens, a cache directory where a first Predictor exported
  its programs, how many)."""
  params, inputs = tiny_model()
  expected = _predictor(request.param).search(params, inputs)[0]
  cache = tmp_path_factory.mktemp("cache")
  first = _predictor(request.param)
  saved = saved_programs.attach(first, str(cache))
  np.testing.assert_array_equal(first.search(params, inputs)[0], expected)
  assert first.programs() >= 2 and saved.loaded == 0
  assert saved.exported == first.programs() == len(_files(cache / saved_programs.SUBDIR))
  return request.param, expected, cache, first.programs()


def test_exported_programs_translate_the_same_and_a_later_run_traces_nothing(exported):
  beam_size, expected, cache, programs = exported
  params, inputs = tiny_model()
  later = _predictor(beam_size)
  saved = saved_programs.attach(later, str(cache))
  with compilation.CompileLog() as log:
    np.testing.assert_array_equal(later.search(params, inputs)[0], expected)
  assert saved.loaded == programs and saved.exported == 0
  assert log.traces["_start_impl"] == 0 and log.traces["_block_impl"] == 0  # nothing re-traced
  assert len(_files(cache / saved_programs.SUBDIR)) == programs


@pytest.mark.parametrize("exported", [4], indirect=True)  # one search: this is about the files
def test_an_unreadable_file_is_exported_again(exported, tmp_path, caplog):
  beam_size, expected, cache, programs = exported
  params, inputs = tiny_model()
  directory = tmp_path / saved_programs.SUBDIR
  shutil.copytree(cache / saved_programs.SUBDIR, directory)
  names = _files(directory)
  for name in names:  # a write cut short, or a file from another serialization version
    with open(directory / name, "r+b") as f:
      f.truncate(16)
  later = _predictor(beam_size)
  saved = saved_programs.attach(later, str(tmp_path))
  with caplog.at_level(logging.WARNING):
    np.testing.assert_array_equal(later.search(params, inputs)[0], expected)
  assert saved.loaded == 0 and saved.exported == len(names) == programs
  assert sum("unreadable" in r.getMessage() for r in caplog.records) == len(names)
  assert _files(directory) == names and all(os.path.getsize(directory / n) > 16 for n in names)


@pytest.mark.parametrize("exported", [4], indirect=True)
def test_a_directory_that_cannot_be_written_costs_nothing_but_the_files(exported, tmp_path, caplog):
  beam_size, expected, _, programs = exported
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
