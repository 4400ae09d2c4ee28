"""Machine translation (§6.1): parallel text in, sacreBLEU out.

Reads the synthetic task, a directory of parallel text files or a TFDS dataset (data/); scores
with sacreBLEU (tasks/bleu.py) and writes the test translations to test_translations.txt.

Two BLEU scores, on the eval split (`scores`) and the test split (`test_results`):
  bleu              cased sacreBLEU on detokenized text (13a): the headline, and the `metric`
                    tune_decoding chooses by.
  bleu_lc_norm_tok  lowercased, punctuation-normalized, Moses-tokenized hypotheses against the
                    dataset's tokenized references (the Multi30k papers' BLEU, bleu.multi30k_bleu):
                    `config.translation.tokenized_{eval,test}_references`, files beside a text
                    source's splits, else the raw references processed the same way.

Token dropout (not in the paper, off by default; Xie et al. 2017's "blank noising"): in each
training batch a piece of the source (`translation.source_token_dropout`) or of the decoder's
input (`translation.target_token_dropout`) is read as <unk> with that probability, independently
per occurrence. EOS, BOS and padding are never replaced, and the targets the loss scores stay the
true pieces.

R-Drop (not in the paper, off by default; Liang et al. 2021): with `translation.rdrop_alpha` = α
> 0 each training batch is run twice, its rows stacked on themselves, so each pair gets two
dropout masks and two output distributions P1 and P2 per target token. The loss is the
label-smoothed cross entropy of both copies plus α times their symmetric KL divergence
½ (KL(P1 || P2) + KL(P2 || P1)) summed over the pair's target tokens, all divided by the tokens
of both copies (Liang et al.'s Eq. 3, in fairseq's normalization). An update costs 2-3x the
compute; evaluation is unchanged. With `translation.rdrop_rows` = f < 1 (a deviation from Liang
et al., who copy every pair) only the first ⌊f b⌋ rows of a batch of b get a copy: the cross
entropy of all b rows and of the copies, the KL over the copied pairs, for (1 + f)x the compute.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Sequence

import ml_collections

from transformer_jax import errors
from transformer_jax.data import pipeline, text
from transformer_jax.data.tokenizer import UNK_ID
from transformer_jax.tasks import base, bleu

TEST_TRANSLATIONS = "test_translations.txt"
MADE_FROM_RAW = "made from raw"  # results.json: no tokenized references file was read

# Token dropout: the batch key of each side -> its config.translation key. A side's random stream
# is its place here, so a side's pieces dropped do not depend on whether the other side's are.
TOKEN_DROPOUT = {"decoder_inputs": "target_token_dropout", "inputs": "source_token_dropout"}

# The split key of `scores` ("eval") and `test_results` ("test") -> its config.data split name.
_SPLIT_NAMES = {"eval": "eval_split", "test": "test_split"}

# R-Drop: the key a doubled training batch carries, one entry per copy, so the loss tells it from
# an evaluation batch and knows how many rows are copies. The copies are stacked after the batch,
# not interleaved: a micro-batch of gradient accumulation (rows k, k + A, ...) then holds its own
# pairs followed by the copies of its first ones (double_batch).
RDROP_COPY = "rdrop_copy"


class TranslationTask(base.Task):
  name = "translation"
  command = "translate"
  sources = ("synthetic", "text", "tfds")
  metric = "bleu"

  def config_section(self):
    s = ml_collections.ConfigDict()
    # The dataset's own tokenized references of the eval and test splits, for bleu_lc_norm_tok:
    # paths relative to data.path (text source), line i being line i of the split's
    # `{split}.{target_lang}` lowercased, punctuation-normalized and Moses-tokenized (Multi30k's
    # tok/*.lc.norm.tok.de). "" or a file that is not there: the raw references are processed
    # as the hypotheses are (bleu.lc_norm_tok), and results.json says so.
    s.tokenized_eval_references = ""
    s.tokenized_test_references = ""
    # Token dropout (module docstring): probabilities in [0, 1); 0 = off, the paper's.
    s.source_token_dropout = 0.0
    s.target_token_dropout = 0.0
    # R-Drop's α (module docstring): 0 = off, the paper's; each update costs 2-3x with it on.
    s.rdrop_alpha = 0.0
    # The fraction of each batch's rows that get a copy (module docstring): 1.0, every row, is
    # Liang et al.'s; less is a deviation, for (1 + rdrop_rows)x the compute.
    s.rdrop_rows = 1.0
    return s

  def validate(self, config, check):
    for key in TOKEN_DROPOUT.values():
      rate = config.translation[key]
      check(0.0 <= rate < 1.0, f"translation.{key}", "must be in [0, 1)")
    alpha = config.translation.rdrop_alpha
    check(alpha >= 0.0, "translation.rdrop_alpha", "must be >= 0 (0: off)")
    if alpha > 0.0:
      check(
          config.model.dropout_rate > 0.0 or config.model.attention_dropout_rate > 0.0,
          "translation.rdrop_alpha",
          "compares two dropout masks: set model.dropout_rate or model.attention_dropout_rate",
      )
    rows = config.translation.rdrop_rows
    check(0.0 < rows <= 1.0, "translation.rdrop_rows", "must be in (0, 1] (1: every row copied)")
    # A tokenized reference file of the wrong length fails here, not after training.
    for key in _SPLIT_NAMES:
      field = f"translation.tokenized_{key}_references"
      given = config.translation[f"tokenized_{key}_references"]
      if not given:
        continue
      check(config.data.source == "text", field, "is read beside a text source's files, or ''")
      path, raw_path = _paths(config, key)
      if not os.path.isfile(path):
        logging.warning(
            "%s: %s is not there; bleu_lc_norm_tok makes its references from %s",
            field,
            path,
            raw_path,
        )
      else:
        lines, raw_lines = text.count_lines(path), text.count_lines(raw_path)
        _check_lengths(path, lines, raw_path, raw_lines, f"config.{field}")

  def load_dataset(self, config, workdir, splits):
    return pipeline.load_corpus(config, workdir, splits)

  def batch_transform(self, config, tokenizer):
    rates = {side: config.translation[key] for side, key in TOKEN_DROPOUT.items()}
    rates = {side: rate for side, rate in rates.items() if rate}
    drop = functools.partial(drop_tokens, rates=rates) if rates else None
    if not config.translation.rdrop_alpha:
      return drop
    rows, micro = config.translation.rdrop_rows, config.train.grad_accum_steps
    return lambda batch, rng: double_batch(drop(batch, rng) if drop else batch, rows, micro)

  def loss(self, config, tokenizer):
    if not config.translation.rdrop_alpha:
      return super().loss(config, tokenizer)
    return functools.partial(
        rdrop_loss,
        label_smoothing=config.train.label_smoothing,
        alpha=config.translation.rdrop_alpha,
    )

  def scores(self, config, hypotheses, pairs):
    """Cased sacreBLEU (`bleu`, the metric) and its `length_ratio`, and `bleu_lc_norm_tok`
    (module docstring) of the eval split's pairs."""
    references = [t for _, t in pairs]
    corpus = bleu.corpus_bleu(hypotheses, references)
    tokenized, _ = tokenized_references(config, "eval", references)
    papers = bleu.multi30k_bleu(hypotheses, tokenized, config.data.target_lang)
    return {
        "bleu": corpus.score,
        "length_ratio": corpus.sys_len / max(corpus.ref_len, 1),
        "bleu_lc_norm_tok": papers.score,
    }

  def test_results(self, config, hypotheses, pairs, workdir, tag=""):
    """Test cased sacreBLEU (`test_bleu`), the Multi30k papers' BLEU (`test_bleu_lc_norm_tok`,
    against the file `test_bleu_lc_norm_tok_references` names, or references "made from raw"),
    and the tokenized BLEU of bleu.tokenized_bleu; the translations go to test_translations.txt
    (with `tag`, test_translations.TAG.txt)."""
    references = [t for _, t in pairs]
    corpus = bleu.corpus_bleu(hypotheses, references)
    lang = config.data.target_lang
    processed, made = tokenized_references(config, "test", references)
    papers = bleu.multi30k_bleu(hypotheses, processed, lang)
    tokenized = bleu.tokenized_bleu(hypotheses, references, lang)
    tokenized_lowercase = bleu.tokenized_bleu(hypotheses, references, lang, lowercase=True)
    if workdir is not None:
      name = TEST_TRANSLATIONS.replace(".txt", f".{tag}.txt") if tag else TEST_TRANSLATIONS
      with open(os.path.join(workdir, name), "w") as f:
        f.writelines(h + "\n" for h in hypotheses)
    return {
        "test_bleu": float(corpus.score),
        "test_bleu_signature": str(corpus),
        "test_bleu_lc_norm_tok": float(papers.score),
        "test_bleu_lc_norm_tok_references": made,
        "test_tokenized_bleu": float(tokenized.score),
        "test_tokenized_bleu_lowercase": float(tokenized_lowercase.score),
    }


def drop_tokens(batch: dict, rng, rates: dict[str, float]) -> dict:
  """Token dropout (module docstring): each piece of `batch[key]` that is not a reserved id
  (PAD, EOS, BOS, UNK) becomes UNK_ID with probability `rates[key]`, independently."""
  import jax
  import jax.numpy as jnp

  out = dict(batch)
  for key, rate in rates.items():
    ids = batch[key]  # [b, L]
    stream = jax.random.fold_in(rng, list(TOKEN_DROPOUT).index(key))
    dropped = jax.random.bernoulli(stream, rate, ids.shape)  # [b, L]
    out[key] = jnp.where(dropped & (ids > UNK_ID), UNK_ID, ids)  # [b, L]
  return out


def double_batch(batch: dict, fraction: float = 1.0, micro_batches: int = 1) -> dict:
  """R-Drop (module docstring): every array of `batch` followed by a copy of its first m rows,
  [b, ...] -> [b + m, ...], and RDROP_COPY [m]: m = ⌊fraction b⌋ rounded down to a multiple of
  `micro_batches` (at least that many). Micro-batch k of gradient accumulation takes rows k,
  k + A, ... (training/train.py), so it then holds its own pairs followed by copies of its first
  m / A of them, as the loss expects."""
  import jax.numpy as jnp

  rows = next(iter(batch.values())).shape[0]
  copies = rows if fraction >= 1.0 else int(fraction * rows) // micro_batches * micro_batches
  copies = min(rows, max(copies, micro_batches))
  out = {key: jnp.concatenate([value, value[:copies]], axis=0) for key, value in batch.items()}
  out[RDROP_COPY] = jnp.ones((copies,), jnp.int32)  # [m]
  return out


def rdrop_loss(logits, batch: dict, label_smoothing: float, alpha: float):
  """The task's loss with R-Drop (module docstring): §5.4's label-smoothed cross entropy of the
  logits [b + m, t, v] of a doubled batch plus α ½ Σ (KL(P1 || P2) + KL(P2 || P1)) over the
  target tokens of its first m rows, P2 the last m rows' (their copies); on a batch that is not
  doubled (evaluation), the cross entropy alone."""
  import jax
  import jax.numpy as jnp

  from transformer_jax.model.config import PAD_ID
  from transformer_jax.training import losses

  loss_sum, metrics = losses.sequence_loss(logits, batch, label_smoothing)
  if RDROP_COPY not in batch:
    return loss_sum, metrics
  rows = batch[RDROP_COPY].shape[0]  # m, static
  log_p = jax.nn.log_softmax(logits[:rows].astype(jnp.float32), axis=-1)  # [m, t, v]
  log_q = jax.nn.log_softmax(logits[-rows:].astype(jnp.float32), axis=-1)  # [m, t, v]
  # ½ (KL(p || q) + KL(q || p)) = ½ Σ_v (p_v - q_v)(log p_v - log q_v)
  symmetric_kl = 0.5 * jnp.sum((jnp.exp(log_p) - jnp.exp(log_q)) * (log_p - log_q), axis=-1)
  weights = (batch["targets"][:rows] != PAD_ID).astype(jnp.float32)  # [m, t]
  return loss_sum + alpha * jnp.sum(symmetric_kl * weights), metrics


def tokenized_references(
    config: ml_collections.ConfigDict, key: str, references: Sequence[str]
) -> tuple[list[str], str]:
  """The lowercased, punctuation-normalized, Moses-tokenized form of `references` (targets of
  split `key`, "eval" or "test", all or some of them), and where it came from: the path of
  `config.translation.tokenized_{key}_references`, whose line i is that of line i of the
  split's target file, or MADE_FROM_RAW (bleu.lc_norm_tok of each reference)."""
  lang = config.data.target_lang
  given = config.translation[f"tokenized_{key}_references"]
  path, raw_path = _paths(config, key) if given else (None, None)
  if path is None or not os.path.isfile(path):
    made = f"{MADE_FROM_RAW} ({path} is not there)" if path else MADE_FROM_RAW
    return [bleu.lc_norm_tok(r, lang) for r in references], made
  raw, tokenized = text.read_lines(raw_path), text.read_lines(path)
  field = f"config.translation.tokenized_{key}_references"
  _check_lengths(path, len(tokenized), raw_path, len(raw), field)
  # By the stripped raw line, as the text source gives its targets: the pairs scored may be the
  # first of the split (eval.num_sentences) and skip a line with an empty side.
  by_raw = {r.strip(): t.strip() for r, t in zip(raw, tokenized)}
  missing = next((r for r in references if r not in by_raw), None)
  if missing is not None:
    raise errors.UserError(
        f"{raw_path} has no line {missing!r}: the references scored are not that split's, "
        f"whose tokenized form {path} ({field}) is"
    )
  return [by_raw[r] for r in references], path


def _paths(config: ml_collections.ConfigDict, key: str) -> tuple[str, str]:
  """The tokenized references file of split `key` and the raw target file it is aligned with."""
  d = config.data
  path = os.path.join(d.path, config.translation[f"tokenized_{key}_references"])
  return path, text.split_path(d.path, d[_SPLIT_NAMES[key]], d.target_lang)


def _check_lengths(path: str, lines: int, raw_path: str, raw_lines: int, field: str) -> None:
  if lines != raw_lines:
    raise errors.UserError(
        f"{path} has {lines} lines but {raw_path} has {raw_lines}: {field} must hold the "
        "split's references line by line, tokenized (or be '' to make them from the raw ones)"
    )


TASK = TranslationTask()
