"""The task interface: everything a task supplies to the generic model, training and decoding.

A task is an object with a `name` (its `config.task`), the `sources` (`config.data.source`
values) it reads, the `command` that decodes its runs, and the hooks below; each has a default
that does nothing, except reading data and scoring, which every task defines. Hooks that shape
training (a batch transform, the model and its loss) and decoding (a constraint) are traced into
the jitted steps and searches: they are JAX-traceable functions and arrays, built once per run.
A task that needs its own model or loss (a head in the place of the decoder, a loss of its own)
builds them (`build_model`, `loss`); the generic model and training name no task.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
  import ml_collections

  from transformer_jax.config import Check
  from transformer_jax.data.pipeline import Dataset
  from transformer_jax.data.tokenizer import Tokenizer

Pair = tuple[str, str]  # (source, target) as text


class Task:
  name: str = ""
  command: str | None = None  # python -m transformer_jax.<command> decodes its runs
  sources: tuple[str, ...] = ()  # the config.data.source values it reads
  metric: str = ""  # the key of `scores` (higher is better) tune_decoding maximizes
  # Keys of its section a run keeps from its start: they shape its parameters or what they mean
  # (the vocabulary's classes); resuming a workdir under other values is refused (train.py).
  model_keys: tuple[str, ...] = ()
  # Keys of its section that change what the search writes (a constraint's switch): the values
  # tune_decoding --try compares, beside config.DECODING_KEYS of config.eval; any other key of
  # the section is refused there.
  decoding_keys: tuple[str, ...] = ()
  # Keys its section no longer has (experiments measured and not adopted; docs/experiments.md):
  # key -> (kept(value, section) -> bool, what it was and the commit that has its code). A saved
  # config.json whose value `kept` accepts loads without it; any other is refused, naming both
  # (config.from_saved).
  retired_keys: dict[str, tuple[Callable[[Any, dict], bool], str]] = {}

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

  def build_model(self, config: ml_collections.ConfigDict, tokenizer: Tokenizer) -> Any:
    """The run's model: a Flax module whose `config` is its TransformerConfig (modes by
    `model.clone(config=model.config.replace(deterministic=True))`), initialized from
    `(inputs, decoder_inputs)` and applied to a batch's model keys (training/train.py). Default:
    the paper's Transformer over the tokenizer's vocabulary (`config.model`)."""
    from transformer_jax import config as config_lib
    from transformer_jax.model.transformer import Transformer

    return Transformer(config_lib.model_config(config, tokenizer.vocab_size))

  def loss(
      self, config: ml_collections.ConfigDict, tokenizer: Tokenizer
  ) -> Callable[[Any, dict], tuple[Any, dict]]:
    """`loss(outputs, batch) -> (loss_sum, metrics)`: what the train step differentiates, traced
    into it; `outputs` is the model's, `metrics` holds the sums "loss_sum", "nll_sum",
    "correct_sum" and "weight_sum" (the gradient is divided by the batch's "weight_sum").
    Default: §5.4's label-smoothed cross entropy of the logits against `batch["targets"]`."""
    import functools

    from transformer_jax.training import losses

    return functools.partial(losses.sequence_loss, label_smoothing=config.train.label_smoothing)

  def batch_keys(self, config: ml_collections.ConfigDict) -> tuple[str, ...] | None:
    """The keys of a training batch (data/batching.py) that the model and the loss read: only
    these go to the devices. None: all of them."""
    return None

  def predictor(self, config: ml_collections.ConfigDict, model: Any, tokenizer: Tokenizer) -> Any:
    """What decodes the run's sources in the place of the beam search (an object with
    decoding.decode.Predictor's `search`, `searches` and `programs`; `model` is `build_model`'s),
    or None: the search, over the paper's Transformer."""
    return None

  def constraint(self, config: ml_collections.ConfigDict, tokenizer: Tokenizer) -> Any:
    """The search's constraint (decoding.decode.Predictor's `constraint`), or None. One whose
    answer renormalizes (the same for any per-row shift) may say `takes_logits = True`."""
    return None

  def scores(
      self, config: ml_collections.ConfigDict, hypotheses: Sequence[str], pairs: Sequence[Pair]
  ) -> dict:
    """Validation scores of decoded outputs against the pairs' targets, `metric` among them. The
    pairs are the eval split's (`config.data.eval_split`): all of them, or the first
    `eval.num_sentences` during training."""
    raise NotImplementedError

  def test_results(
      self,
      config: ml_collections.ConfigDict,
      hypotheses: Sequence[str],
      pairs: Sequence[Pair],
      workdir: str | None,
      tag: str = "",
  ) -> dict:
    """The test split's (`config.data.test_split`) scores for results.json; its outputs written
    to `workdir` if given, in files whose names carry `tag` ("tuned": tune_decoding's) before
    their extension."""
    raise NotImplementedError
