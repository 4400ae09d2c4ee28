"""Table 3 of the paper (§6.2): every variation of the base model, one config per row.

Reproduces: each row is `configs/base.py` (WMT 2014 EN→DE, 100k steps) with the row's changes,
scored as §6.2 did on newstest2013 with beam 4, α 0.6 and no checkpoint averaging. Variants (the
row, after the colon): base; A1-A4 heads h = 1, 4, 16, 32 (d_k = d_v = d_model/h); B1-B2 d_k 16,
32; C1-C3 N = 2, 4, 8; C4-C5 d_model 256, 1024; C6-C7 d_ff 1024, 4096; D1-D2 P_drop 0.0, 0.2;
D3-D4 ε_ls 0.0, 0.2; E learned positions; big.

Expected: the paper's dev PPL, BLEU and parameters, in `PAPER` below (BLEU here is sacreBLEU:
compare rows with each other). Hardware and time: as base.py per row, big as big.py; not yet run.

  python train.py --config configs/table3.py:B1 --workdir gs://BUCKET/table3/B1
  python -m transformer_jax.sweep --config configs/table3.py --rows A1,A2,A3,A4 \\
      --workdir_root gs://BUCKET/table3    # each row in turn, then table.md there
"""

from configs import base
from transformer_jax import sweep

# Row -> (changes to the base config, paper's dev PPL, dev BLEU, params ×10^6 or None).
PAPER = {
    "base": ({}, 4.92, 25.8, 65),
    "A1": ({"model.num_heads": 1}, 5.29, 24.9, None),  # d_k = d_v = 512
    "A2": ({"model.num_heads": 4}, 5.00, 25.5, None),  # 128
    "A3": ({"model.num_heads": 16}, 4.91, 25.8, None),  # 32
    "A4": ({"model.num_heads": 32}, 5.01, 25.4, None),  # 16
    "B1": ({"model.key_dim": 16}, 5.16, 25.1, 58),
    "B2": ({"model.key_dim": 32}, 5.01, 25.4, 60),
    "C1": ({"model.num_layers": 2}, 6.11, 23.7, 36),
    "C2": ({"model.num_layers": 4}, 5.19, 25.3, 50),
    "C3": ({"model.num_layers": 8}, 4.88, 25.5, 80),
    "C4": ({"model.d_model": 256}, 5.75, 24.5, 28),  # d_k = d_v = 32
    "C5": ({"model.d_model": 1024}, 4.66, 26.0, 168),  # d_k = d_v = 128
    "C6": ({"model.d_ff": 1024}, 5.12, 25.4, 53),
    "C7": ({"model.d_ff": 4096}, 4.75, 26.2, 90),
    "D1": ({"model.dropout_rate": 0.0}, 5.77, 24.6, None),
    "D2": ({"model.dropout_rate": 0.2}, 4.95, 25.5, None),
    "D3": ({"train.label_smoothing": 0.0}, 4.67, 25.3, None),
    "D4": ({"train.label_smoothing": 0.2}, 5.47, 25.7, None),
    "E": ({"model.positional": "learned"}, 4.92, 25.7, None),
    "big": (
        {
            "model.d_model": 1024,
            "model.d_ff": 4096,
            "model.num_heads": 16,
            "model.dropout_rate": 0.3,
            "train.num_steps": 300_000,
        },
        4.33,
        26.4,
        213,
    ),
}


def get_config(arg: str | None = None):
  row = arg or "base"
  if row not in PAPER:
    from transformer_jax.config import ConfigError

    raise ConfigError(
        f"configs/table3.py:{arg}: unknown Table 3 row {row!r}; expected one of {', '.join(PAPER)}"
    )
  config = base.get_config()
  # §6.2: development set (newstest2013) for both numbers, no checkpoint averaging; the test
  # split is set to it, so the final evaluation decodes newstest2013.
  config.data.test_split = config.data.eval_split
  # Rows run side by side (sweep.py) share one prepared corpus: prepared/ beside their workdirs.
  config.train.average_last = 0
  config.train.keep_checkpoints = 5
  config.eval.beam_size = 4
  config.eval.alpha = 0.6
  sweep.apply_changes(config, PAPER[row][0])
  return config
