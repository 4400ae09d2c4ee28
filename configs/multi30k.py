"""A small Transformer on Multi30k English→German (Task 1, test2016), trained on a CPU.

Reproduces: no row of the paper; the paper's recipe (post-norm Transformer, shared joint BPE
vocabulary and embeddings, Adam with warmup and inverse-square-root decay, label smoothing 0.1,
§5) scaled down to a corpus of 29k caption pairs: 3 layers, d_model 256, 4 heads, d_ff 1024,
dropout 0.1, an 8k joint SentencePiece BPE vocabulary, batches of ~6k tokens per side.

Expected: sacreBLEU >= 38 on test2016 (greedy decoding, cased, detokenized references). This is
the target the config is meant to reach, still to be measured end to end: see the run's
results.json and the README for the measured figure.

Hardware and time: about 1.0 s per step on a 2-core CPU, so the default num_steps
fit in about 55 minutes of training (about 33 epochs), plus a minute of data preparation and
compilation and a few minutes of final evaluation.

Data: `../shared/data/multi30k` beside the repository (train/valid/test.{en,de}, raw, cased);
point elsewhere with `--config.data.path=DIR`. Multi30k: Elliott, Frank, Sima'an and Specia,
"Multi30K: Multilingual English-German Image Descriptions", Proceedings of the 5th Workshop on
Vision and Language, 2016 (doi:10.18653/v1/W16-3210). For non-commercial research and
educational use only (see the dataset's README).

Command:
  python train.py --config configs/multi30k.py --workdir /tmp/multi30k
"""

import os

from transformer_jax.config import default_config

# <repo>/../shared/data/multi30k, wherever the command is run from.
DATA_DIR = os.path.normpath(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "data",
                 "multi30k")
)


def get_config(arg: str | None = None):
  del arg
  config = default_config()
  config.model.d_model = 256
  config.model.num_heads = 4
  config.model.num_layers = 3
  config.model.d_ff = 1024
  config.model.dropout_rate = 0.1
  config.model.max_len = 128  # room for decoding up to input length + max_decode_extra

  config.data.source = "text"
  config.data.path = DATA_DIR
  config.data.source_lang = "en"
  config.data.target_lang = "de"
  config.data.train_split = "train"
  config.data.eval_split = "valid"
  config.data.test_split = "test"  # test_2016_flickr
  config.data.vocab_size = 8000
  config.data.spm_max_sentences = 100_000  # the whole training set, both sides (58k)
  config.data.max_len = 64  # the longest pair has 52 pieces, so nothing is truncated
  config.data.tokens_per_batch = 6144
  # 32 buckets, 2 apart: captions are short and the two sides share one padded length, so
  # coarser buckets waste a quarter of every batch on padding (0.77 with 8 buckets, 0.91 here).
  config.data.num_buckets = 32
  config.data.bucket_step = 2

  config.train.num_steps = 3300
  config.train.warmup_steps = 1000  # §5.3's 4000 is most of this short run
  config.train.log_every = 100
  config.train.checkpoint_every = 500
  config.train.keep_checkpoints = 3
  config.train.eval_every = 1000

  config.eval.batch_size = 128
  config.eval.num_sentences = 500
  config.eval.max_decode_extra = 25  # captions: a translation is rarely 25 pieces longer
  return config
