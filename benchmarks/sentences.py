"""The source sentences the decoding benchmarks run on (decode.py, profile_decode.py, beam_work)."""

import pathlib


def source_ids(run, workdir: str, input_path: str | None, limit: int = 0) -> list[list[int]]:
  """Token ids (no EOS) of `input_path`'s lines (empty lines left out), else of the test split of
  the run `run` loaded from `workdir` (its vocabulary reused); the first `limit` (0: all)."""
  from transformer_jax.data import pipeline

  if input_path:
    lines = pathlib.Path(input_path).read_text(encoding="utf-8").splitlines()
  else:
    dataset = pipeline.load_dataset(run.config, workdir, splits=("test",), task=run.task)
    lines = [src for src, _ in dataset.splits["test"].pairs]
  sources = [ids for ids in run.encode_lines(lines) if ids is not None]
  return sources[:limit] if limit else sources
