"""The task interface: everything a task supplies to the generic model, training and decoding.

A task is an object with a `name` (its `config.task`), the `sources` (`config.data.source`
values) it reads, the `command` that decodes its runs, and the hooks below; each has a default
that does nothing, except reading data and scoring, which every task defines. Hooks that shape
training (a batch transform, interchangeable tokens) and decoding (a constraint) are traced into
the jitted steps and searches: they are JAX-traceable functions and arrays, built once per run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
  import ml_collections
  import numpy as np

  from transformer_jax.config import Check
  from transformer_jax.data.pipeline import Dataset
  from transformer_jax.data.tokenizer import Tokenizer

Pair = tuple[str, str]  # (source, target) as text


class Task:
  name: str = ""
  command: str | None = None  # python -m transformer_jax.<command> decodes its runs
  sources: tuple[str, ...] = ()  # the config.data.source values it reads
  metric: str = ""  # the validation score (higher is better) tune_decoding maximizes
  # Keys of its section a run keeps from its start: they shape its parameters or what they mean
  # (the vocabulary's classes); resuming a workdir under other values is refused (train.py).
  model_keys: tuple[str, ...] = ()

  def config_section(self) -> ml_collections.ConfigDict | None:
    """The defaults of the task's own keys, `config.<name>` (None: it has none)."""
    return None

  def validate(self, config: ml_collections.ConfigDict, check: Check) -> None:
    """Checks of the task's section, and of what it needs from the others (config.checker)."""

  def load_dataset(
      self, config: ml_collections.ConfigDict, workdir: str | None, splits: Sequence[str]
  ) -> Dataset:
    """The vocabulary (the workdir's, or made and kept there) and the tokenized `splits`
    ("train", "eval", "test") as data.pipeline.Dataset."""
    raise NotImplementedError

  def batch_transform(
      self, config: ml_collections.ConfigDict, tokenizer: Tokenizer
  ) -> Callable[[dict, Any], dict] | None:
    """`transform(batch, rng) -> batch`, applied to every training batch inside the jitted
    train step with its own random stream (None: batches as they are)."""
    return None

  def interchangeable_tokens(
      self, config: ml_collections.ConfigDict, tokenizer: Tokenizer
  ) -> np.ndarray | None:
    """[vocab] bool: tokens the loss scores as one class (training.losses); None: the paper's
    loss, every token its own class."""
    return None

  def output_tokens(self, config: ml_collections.ConfigDict, tokenizer: Tokenizer) -> int:
    """N > 0: the decoder scores ids 0..N-1 one by one and every later id (and the
    `interchangeable_tokens`) as one output (a deviation: model/config.py's `output_tokens`,
    config.run_model_config); 0: every id its own output, the paper's."""
    return 0

  def source_chars(self, config: ml_collections.ConfigDict) -> int:
    """C > 0: each source token comes with C character ids of its spelling, whose features the
    encoder adds to its embedding (a deviation: model/config.py's `source_chars`; the task's
    sources are then [n, 1 + C] arrays); 0: a token is its id, the paper's."""
    return 0

  def source_affixes(self, config: ml_collections.ConfigDict) -> bool:
    """True: the C ids of `source_chars` are hashed affixes, embedded and summed (a deviation:
    model/config.py's `source_affixes`); False: characters."""
    return False

  def has_decoder(self, config: ml_collections.ConfigDict) -> bool:
    """False where `chart_model` gives the model no decoder: what the config's checks need to
    know before there is a vocabulary (a model without one may see order by relative positions
    alone, model/config.py `positional="none"`)."""
    return True

  def chart_model(self, config: ml_collections.ConfigDict, tokenizer: Tokenizer) -> dict:
    """{"chart_labels": L, "chart_tags": T, "chart_hidden": H}: the model has no decoder but a
    span chart over its encoder (a deviation: model/config.py `chart_labels`; its targets are
    training/losses.py's chart targets, its search the task's `predictor`); {}: the paper's
    encoder-decoder."""
    return {}

  def predictor(
      self, config: ml_collections.ConfigDict, model_config: Any, tokenizer: Tokenizer
  ) -> Any:
    """What decodes the run's sources in the place of the beam search (an object with
    decoding.decode.Predictor's `search`, `searches` and `programs`), or None: the search."""
    return None

  def constraint(self, config: ml_collections.ConfigDict, tokenizer: Tokenizer) -> Any:
    """The search's constraint (decoding.decode.Predictor's `constraint`), or None. One whose
    answer renormalizes (the same for any per-row shift) may say `takes_logits = True`."""
    return None

  def scores(
      self, config: ml_collections.ConfigDict, hypotheses: Sequence[str], pairs: Sequence[Pair]
  ) -> dict:
    """Validation scores of decoded outputs against the pairs' targets, `metric` among them."""
    raise NotImplementedError

  def test_results(
      self,
      config: ml_collections.ConfigDict,
      hypotheses: Sequence[str],
      pairs: Sequence[Pair],
      workdir: str | None,
  ) -> dict:
    """The test split's scores for results.json; its outputs written to `workdir` if given."""
    raise NotImplementedError
