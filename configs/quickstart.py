"""Quickstart: a tiny Transformer on the built-in synthetic translation task, offline, on a CPU.

Reproduces: nothing from the paper; it shows the whole pipeline (data, training, checkpoints,
decoding, sacreBLEU) end to end in minutes. The synthetic task (`transformer_jax/data/
synthetic.py`) needs attention and reordering: verbs move to the end, adjectives follow their
noun, and determiners agree with the noun.

Expected: test sacreBLEU > 90 (greedy). Hardware and time: 2 CPU cores, ~4 minutes for the 600
steps, compilation included.

Variants: `:smoke` trains 4 steps, for tests.

  python train.py --config configs/quickstart.py --workdir /tmp/quickstart
"""

from transformer_jax.config import default_config


def get_config(arg: str | None = None):
  if arg not in (None, "", "smoke"):
    from transformer_jax.config import ConfigError

    raise ConfigError(
        f"configs/quickstart.py:{arg}: unknown variant; expected configs/quickstart.py or "
        "configs/quickstart.py:smoke"
    )
  config = default_config()
  config.model.d_model = 128
  config.model.num_heads = 4
  config.model.num_layers = 2
  config.model.d_ff = 512
  config.model.dropout_rate = 0.1
  config.model.max_len = 64

  config.data.source = "synthetic"
  config.data.max_len = 40
  config.data.tokens_per_batch = 2048

  config.train.num_steps = 600
  config.train.warmup_steps = 300
  # Peak lr 2.6e-3 at step 300 (Eq. 3 with d_model=128); the full multiplier (5.1e-3 peak)
  # makes this tiny model's BLEU oscillate between evaluations.
  config.train.lr_multiplier = 0.5
  config.train.log_every = 100
  config.train.eval_every = 200
  config.train.checkpoint_every = 200
  config.train.keep_checkpoints = 2

  config.eval.batch_size = 128
  config.eval.num_sentences = 200
  config.eval.max_decode_extra = 10
  config.eval.beam_size = 1  # greedy: the synthetic task has one right answer
  if arg == "smoke":  # a few steps, for tests: `--config configs/quickstart.py:smoke`
    config.train.num_steps = 4
    config.train.log_every = 2
    config.train.checkpoint_every = 2
    config.train.eval_every = 0
    config.data.bucket_step = config.data.max_len  # one bucket: one compiled shape
    config.data.synthetic_train_size = 2000
    config.data.synthetic_eval_size = 32
    config.eval.num_sentences = 32
  return config
