"""Tasks added without editing a library file, defined here, registered by name and trained and
evaluated through the same entry as train.py (`training.train.run`), each in a short run that
learns it: reversing a sequence of symbols (the paper's model, scored by exact match), and
tagging each symbol with a model and loss of the task's own (the generic embedding and Encoder and
a tag head; no decoder), scored by tag accuracy."""

import functools
import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from transformer_jax import config as config_lib
from transformer_jax import tasks
from transformer_jax.data import pipeline
from transformer_jax.data.tokenizer import EOS_ID, PAD_ID, WordTokenizer
from transformer_jax.model.config import TransformerConfig
from transformer_jax.model.transformer import Embed, Encoder
from transformer_jax.runs import inference
from transformer_jax.tasks import base
from transformer_jax.training import train


class ReversalTask(base.Task):
  """Source: 2-6 symbols; target: the same symbols in reverse order."""

  name = "reversal"
  sources = ("generated",)
  metric = "exact_match"

  def config_section(self):
    return ml_collections.ConfigDict({"symbols": 8, "seed": 0, "train_size": 3000, "eval_size": 64})

  def validate(self, config, check):
    check(2 <= config.reversal.symbols <= 26, "reversal.symbols", "must be in [2, 26]")

  def load_dataset(self, config, workdir, splits):
    r = config.reversal
    symbols = [chr(ord("a") + i) for i in range(r.symbols)]
    tokenizer = pipeline.word_tokenizer(WordTokenizer(symbols), workdir)  # kept in the workdir
    rng = np.random.default_rng(r.seed)
    sizes = {"test": r.eval_size, "eval": r.eval_size, "train": r.train_size}  # fixed order
    out = {}
    for key, size in sizes.items():
      sources = [" ".join(rng.choice(symbols, rng.integers(2, 7))) for _ in range(size)]
      pairs = [(s, " ".join(reversed(s.split()))) for s in sources]
      if key in splits:
        examples = [(tokenizer.encode(s), tokenizer.encode(t)) for s, t in pairs]
        out[key] = pipeline.Split(pairs, examples)
    return pipeline.Dataset(tokenizer, out)

  def scores(self, config, hypotheses, pairs):
    return {"exact_match": float(np.mean([h == t for h, (_, t) in zip(hypotheses, pairs)]))}

  def test_results(self, config, hypotheses, pairs, workdir, tag=""):
    if workdir is not None:
      with open(os.path.join(workdir, "test_reversed.txt"), "w") as f:
        f.writelines(h + "\n" for h in hypotheses)
    return {f"test_{k}": v for k, v in self.scores(config, hypotheses, pairs).items()}


def _registered(task):
  """A fixture's body: `task` registered for the test, forgotten after it."""
  yield tasks.register(task)
  tasks.unregister(task.name)


@pytest.fixture
def reversal():
  yield from _registered(ReversalTask())


def _config(task="reversal", max_len=8, num_steps=300):
  """A small, short run of `task` on its generated data, greedy evaluation."""
  config = config_lib.default_config(task)
  config.data.source = "generated"
  config.model.update(d_model=64, num_heads=4, num_layers=2, d_ff=128, max_len=16)
  config.model.dropout_rate = 0.0
  config.data.update(max_len=max_len, num_buckets=1, tokens_per_batch=1024, vocab_size=16)
  config.train.update(num_steps=num_steps, warmup_steps=60, lr_multiplier=0.5, log_every=100)
  config.train.update(checkpoint_every=num_steps, keep_checkpoints=1)
  config.eval.update(beam_size=1, batch_size=64, num_sentences=64)
  return config


@pytest.mark.slow  # ~30 s on 2 cores: .ci/run runs it after the default suite
def test_a_task_defined_outside_the_package_trains_and_scores_through_the_same_entry(
    reversal, tmp_path
):
  config = _config()
  config.reversal.symbols = 1
  with pytest.raises(config_lib.ConfigError, match=r"config.reversal.symbols=1: must be in"):
    config_lib.validate(config)  # the task's own checks run with every config's
  config.reversal.symbols = 8
  results = train.run(config, str(tmp_path), devices=jax.devices()[:1])
  assert results["step"] == 300 and results["test_sentences"] == 64
  assert results["test_exact_match"] >= 0.9, results  # it learned to reverse
  written = (tmp_path / "test_reversed.txt").read_text().splitlines()
  assert len(written) == 64
  saved = json.loads((tmp_path / "config.json").read_text())
  assert saved["task"] == "reversal" and saved["reversal"]["symbols"] == 8
  # The built-in commands refuse its run, in one line.
  with pytest.raises(tasks.UserError, match="is a reversal run .* no command decodes it"):
    tasks.check_command(str(tmp_path), "translate")


# ----------------------------------------------------------------------------- a task's own head

TAGS = ("<once>", "<again>")  # a symbol's tag: it occurs once in its sentence, or more often


class Tagger(nn.Module):
  """The generic embedding and Encoder, then a linear layer scoring each token's tags: no decoder.
  inputs [b, s] -> logits [b, s, len(TAGS)]."""

  config: TransformerConfig

  def setup(self):
    self.embedding = Embed(self.config)
    self.encoder = Encoder(self.config, embed=self.embedding)
    self.tags = nn.Dense(
        len(TAGS),
        kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", None)),
    )

  def __call__(self, inputs, decoder_inputs=None, inputs_positions=None, **unused):
    del decoder_inputs, unused  # initialized like any model, (inputs, decoder_inputs); not read
    return self.tags(self.encoder(inputs, inputs_positions)).astype(jnp.float32)


def tag_loss(logits, batch, tag_ids):
  """Each token's tag's cross entropy (targets: the tags' token ids, EOS and PAD weigh 0)."""
  targets = batch["targets"]  # [b, s]
  index = jnp.argmax(targets[..., None] == jnp.asarray(tag_ids), axis=-1)  # [b, s]
  valid = jnp.isin(targets, jnp.asarray(tag_ids))
  nll = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, index[..., None], -1)[..., 0]
  nll_sum = jnp.sum(jnp.where(valid, nll, 0.0))
  correct = jnp.sum((jnp.argmax(logits, -1) == index) & valid)
  weight = jnp.sum(valid).astype(jnp.float32)
  return nll_sum, {
      "loss_sum": nll_sum,
      "nll_sum": nll_sum,
      "correct_sum": correct,
      "weight_sum": weight,
  }


class TagPredictor:
  """Decodes a batch in one pass: each source token's best tag, then EOS (the search's output
  form, so that the generic decoding path, scoring and the commands read it as a search's)."""

  def __init__(self, model, tag_ids):
    self.model = model.clone(config=model.config.replace(deterministic=True))
    self.tag_ids = np.asarray(tag_ids, np.int32)
    self.shapes = set()
    self._best = jax.jit(
        lambda params, inputs: jnp.argmax(self.model.apply({"params": params}, inputs), -1)
    )

  def search(self, params, inputs, alpha=None, beam_size=None, stats=None, sentences=None):
    self.shapes.add(inputs.shape)
    best = np.asarray(jax.device_get(self._best(params, inputs)))  # [b, s]
    source = np.asarray(jax.device_get(inputs))
    is_token = (source != PAD_ID) & (source != EOS_ID)
    out = np.where(is_token, self.tag_ids[best], PAD_ID).astype(np.int32)
    out[source == EOS_ID] = EOS_ID
    return out, 1

  def searches(self):
    return len(self.shapes)

  def programs(self):
    return len(self.shapes)


class TaggingTask(base.Task):
  """Source: 3-7 symbols; target: each symbol's tag (TAGS): whether its symbol occurs elsewhere
  in the sentence, which only attention over the sentence can tell."""

  name = "tagging"
  sources = ("generated",)
  metric = "tag_accuracy"

  def config_section(self):
    return ml_collections.ConfigDict({"symbols": 6, "seed": 1, "train_size": 3000, "eval_size": 64})

  def load_dataset(self, config, workdir, splits):
    r = config.tagging
    symbols = [chr(ord("a") + i) for i in range(r.symbols)]
    tokenizer = pipeline.word_tokenizer(WordTokenizer(symbols + list(TAGS)), workdir)
    rng = np.random.default_rng(r.seed)
    out = {}
    for key, size in {"test": r.eval_size, "eval": r.eval_size, "train": r.train_size}.items():
      sources = [list(rng.choice(symbols, rng.integers(3, 8))) for _ in range(size)]
      pairs = [(" ".join(s), " ".join(TAGS[s.count(x) > 1] for x in s)) for s in sources]
      if key in splits:
        examples = [(tokenizer.encode(s), tokenizer.encode(t)) for s, t in pairs]
        out[key] = pipeline.Split(pairs, examples)
    return pipeline.Dataset(tokenizer, out)

  def _tag_ids(self, tokenizer):
    return [tokenizer.encode(t)[0] for t in TAGS]

  def build_model(self, config, tokenizer):
    return Tagger(config_lib.model_config(config, tokenizer.vocab_size))

  def loss(self, config, tokenizer):
    return functools.partial(tag_loss, tag_ids=self._tag_ids(tokenizer))

  def batch_keys(self, config):
    return ("inputs", "targets")  # no decoder inputs: the model has no decoder

  def predictor(self, config, model, tokenizer):
    return TagPredictor(model, self._tag_ids(tokenizer))

  def scores(self, config, hypotheses, pairs):
    pairs_of_tags = [(h.split(), t.split()) for h, (_, t) in zip(hypotheses, pairs)]
    right = sum(a == b for h, t in pairs_of_tags for a, b in zip(h, t))
    return {"tag_accuracy": right / max(sum(len(t) for _, t in pairs_of_tags), 1)}

  def test_results(self, config, hypotheses, pairs, workdir, tag=""):
    return {f"test_{k}": v for k, v in self.scores(config, hypotheses, pairs).items()}


@pytest.fixture
def tagging():
  yield from _registered(TaggingTask())


@pytest.mark.slow  # ~30 s on 2 cores: .ci/run runs it after the default suite
def test_a_task_with_its_own_model_and_loss_trains_and_scores_through_the_same_entry(
    tagging, tmp_path
):
  config = _config("tagging", max_len=9, num_steps=400)
  config.train.label_smoothing = 0.0
  trainer = train.Trainer.for_task(
      config, tagging, tagging.load_dataset(config, None, ()).tokenizer
  )
  assert isinstance(trainer.train_model, Tagger) and trainer.batch_keys == ("inputs", "targets")
  results = train.run(config, str(tmp_path), devices=jax.devices()[:1])
  assert results["step"] == 400 and results["test_sentences"] == 64
  assert results["test_tag_accuracy"] >= 0.9, results  # it learned which symbols repeat
  assert results["eval_accuracy"] >= 0.9, results  # its loss's tag accuracy on validation
  # Its parameters are its own model's: the generic embedding and encoder and its head.
  params = inference.load_run(str(tmp_path)).params
  assert set(params) == {"embedding", "encoder", "tags"}
