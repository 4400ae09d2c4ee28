"""Transformer base, WMT 2014 English→German: Table 2 and Table 3 row "base" of the paper.

Reproduces: 6 layers, d_model 512, 8 heads, d_ff 2048, P_drop 0.1, ε_ls 0.1, a shared ~37k
SentencePiece vocabulary (the paper used BPE), batches of ~25k source + ~25k target tokens, 100k
steps with warmup 4000 (§5), the average of the last 5 checkpoints, beam 4, α 0.6 (§6.1).

Expected: 27.3 BLEU on newstest2014 (the paper's). Hardware and time: the paper's 12 hours on 8
P100 GPUs; not yet run on WMT here (train-step speed: docs/benchmarks.md). No variants.

Data: TFDS `wmt14_translate/de-en`, read as EN→DE (`pip install -e '.[tfds]'`).

  python train.py --config configs/base.py --workdir gs://BUCKET/base
"""

from transformer_jax.config import default_config


def get_config(arg: str | None = None):
  if arg:
    from transformer_jax.config import ConfigError

    raise ConfigError(f"configs/base.py:{arg}: base.py takes no variant; use configs/base.py")
  config = default_config()
  config.data.source = "tfds"
  config.data.tfds_name = "wmt14_translate/de-en"
  config.data.source_lang = "en"
  config.data.target_lang = "de"
  config.data.eval_split = "validation"
  config.data.test_split = "test"
  config.data.vocab_size = 37000
  config.data.max_len = 256
  config.data.tokens_per_batch = 25_000  # per side, per update (§5.1)
  # Packed rows of 256 (96 rows a batch on 8 devices): ~0.96 of positions are real tokens on a
  # WMT-sized corpus, against 0.68 with 8 length buckets, and one jit shape instead of 8; see
  # benchmarks/pipeline.py --compare_packing. Prepared once into config.data.cache_dir
  # (default: prepared/ beside the workdir) by the first run or `python -m
  # transformer_jax.prepare_data --config configs/base.py`.
  config.data.packing = True
  config.model.max_len = 256
  config.model.dtype = "bfloat16"  # mixed precision on accelerators; fp32 master weights
  config.train.num_steps = 100_000
  config.train.warmup_steps = 4000
  config.train.log_every = 100
  # §6.1: checkpoints every 10 minutes (0.4 s/step on 8 P100s -> 1500 steps), and the final
  # model is the average of the last 5.
  config.train.checkpoint_every = 1500
  config.train.keep_checkpoints = 20
  config.train.average_last = 5
  config.train.eval_every = 5000
  config.eval.batch_size = 256
  config.eval.num_sentences = 1000
  return config
