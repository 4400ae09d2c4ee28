"""Transformer big, WMT 2014 English→German: Table 2 and Table 3 row "big" of the paper.

Reproduces: 6 layers, d_model 1024, 16 heads, d_ff 4096, P_drop 0.3, ε_ls 0.1, 300k steps (§5.2,
Table 3), the average of the last 20 checkpoints, beam 4, α 0.6 (§6.1); the rest as base.py.

Expected: 28.4 BLEU on newstest2014 EN→DE, 41.8 EN→FR (the paper's). Hardware and time: the
paper's 3.5 days on 8 P100 GPUs; not yet run on WMT here (train-step speed: docs/benchmarks.md).

Variants: `configs/big.py:enfr` is EN→FR (WMT 2014 fr-en, P_drop 0.1).

  python train.py --config configs/big.py --workdir gs://BUCKET/big
  python train.py --config configs/big.py:enfr --workdir gs://BUCKET/big_enfr
"""

from configs import base


def get_config(arg: str | None = None):
  config = base.get_config()
  config.model.d_model = 1024
  config.model.num_heads = 16
  config.model.d_ff = 4096
  config.model.dropout_rate = 0.3
  config.train.num_steps = 300_000
  config.train.checkpoint_every = 600  # §6.1: every 10 minutes at 1.0 s/step
  config.train.average_last = 20  # §6.1: average of the last 20 checkpoints
  if arg == "enfr":
    config.data.tfds_name = "wmt14_translate/fr-en"
    config.data.target_lang = "fr"
    config.model.dropout_rate = 0.1  # §6.1: P_drop = 0.1 for EN-FR big
  elif arg:
    from transformer_jax.config import ConfigError

    raise ConfigError(
        f"configs/big.py:{arg}: unknown variant; expected configs/big.py or configs/big.py:enfr"
    )
  return config
