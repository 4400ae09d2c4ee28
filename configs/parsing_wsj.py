"""§6.3 English constituency parsing, WSJ only: Table 4's "Transformer (4 layers), WSJ only" row.

Reproduces: a 4-layer Transformer with d_model 1024, every other setting as the base model (§6.3),
on the Penn Treebank's WSJ sections 02-21 (22 for development, 23 for test); a 16K-token
vocabulary of whole tokens; beam 21, α 0.3, output length up to input + 300; trees top-down with
predicted tags. Dropout 0.2 and a 16k-step warm-up (the paper gives neither) are tensor2tensor's
`transformer_parsing_base`, still to be checked on section 22 (docs/parsing.md).

Expected: 91.3 F1 on section 23 (EVALB, COLLINS.prm; the paper's). Hardware and time: not given
by the paper; not yet run here (the treebank is not free). No variants. Data: Penn Treebank 3
(LDC99T42), `parsed/mrg/wsj/NN/wsj_NNNN.mrg`; pass its `wsj` directory.

  python train.py --config configs/parsing_wsj.py --config.data.path=PTB3/parsed/mrg/wsj \\
      --workdir DIR
"""

from transformer_jax.config import default_config


def get_config(arg: str | None = None):
  if arg:
    from transformer_jax.config import ConfigError

    raise ConfigError(
        f"configs/parsing_wsj.py:{arg}: parsing_wsj.py takes no variant; use "
        "configs/parsing_wsj.py"
    )
  config = default_config("parsing")
  config.model.num_layers = 4
  config.model.d_model = 1024
  config.model.num_heads = 8
  config.model.d_ff = 2048
  config.model.dropout_rate = 0.2
  config.model.attention_dropout_rate = 0.2
  config.model.max_len = 600  # room for the longest input bucket (data.max_len) + 300
  config.model.dtype = "bfloat16"  # mixed precision on accelerators; fp32 master weights

  config.data.source = "ptb"
  config.data.path = ""  # the user's PTB3/parsed/mrg/wsj: --config.data.path=DIR
  config.data.train_split = "02-21"
  config.data.eval_split = "22"
  config.data.test_split = "23"
  config.parsing.tree_closing = "labeled"
  config.data.vocab_size = 16_000  # §6.3: a 16K-token vocabulary for WSJ only
  config.data.max_len = 300  # a linearized tree is ~2.6 times its sentence; few are longer
  config.data.tokens_per_batch = 25_000  # as base (§5.1)
  config.data.num_buckets = 16

  config.train.num_steps = 100_000
  config.train.warmup_steps = 16_000
  config.train.log_every = 100
  config.train.checkpoint_every = 1500
  config.train.keep_checkpoints = 20
  config.train.average_last = 5
  config.train.eval_every = 5000

  # §6.3: beam 21, α 0.3, maximum output length = input length + 300.
  config.eval.beam_size = 21
  config.eval.alpha = 0.3
  config.eval.max_decode_extra = 300
  config.eval.batch_size = 64
  config.eval.num_sentences = 500
  return config
