"""Input pipeline: tokenizers, sources, prepared (memory-mapped) corpora, batching and packing."""

from transformer_jax.data.batching import (
    BatchIterator,
    eval_batches,
    make_bucket_lengths,
    padding_efficiency,
)
from transformer_jax.data.synthetic import SyntheticTask
from transformer_jax.data.tokenizer import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    UNK_ID,
    SentencePieceTokenizer,
    Tokenizer,
    WordTokenizer,
    load_tokenizer,
    train_sentencepiece,
)
