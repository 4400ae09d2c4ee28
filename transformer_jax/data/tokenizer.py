"""Tokenizers: text <-> int ids, with four reserved ids shared project-wide.

The ids 0..3 are fixed for every tokenizer so that the model, the losses and
the decoder can rely on them without asking the tokenizer:

    PAD_ID = 0  padding; masked out of attention and of the loss
    EOS_ID = 1  end of sentence; appended to sources and targets
    BOS_ID = 2  start of sentence; the first decoder input (targets shifted right)
    UNK_ID = 3  out-of-vocabulary words

`encode` never appends EOS or BOS: batching adds them (data/batching.py), so a
tokenized corpus can be truncated, bucketed and shifted in one place.

Two implementations: `WordTokenizer` (whitespace words over a fixed list, used
by the synthetic task) and `SentencePieceTokenizer` (subwords, as in the paper's
shared 37k BPE vocabulary, §5.1), trained by `train_sentencepiece`.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Sequence
from typing import Protocol

import sentencepiece as spm

from transformer_jax.errors import UserError

# What to do about a damaged vocabulary file: a run's checkpoints hold ids of this vocabulary,
# so no other file can stand in for it.
DAMAGED = (
    "the file is damaged or cut short; restore it from a copy (the run's checkpoints were "
    "trained with this vocabulary) or retrain in a new --workdir"
)

PAD_ID = 0
EOS_ID = 1
BOS_ID = 2
UNK_ID = 3
# Spelled like SentencePiece's defaults so both tokenizers print the same.
RESERVED_TOKENS = ("<pad>", "</s>", "<s>", "<unk>")


class Tokenizer(Protocol):
  """What the rest of the project needs from a tokenizer."""

  @property
  def vocab_size(self) -> int:
    """Number of ids, reserved ones included: the model's embedding rows."""
    ...

  def encode(self, text: str) -> list[int]:
    """Ids of `text`, without EOS or BOS."""
    ...

  def decode(self, ids: Sequence[int]) -> str:
    """Text of `ids` up to the first EOS, skipping PAD and BOS."""
    ...

  def decode_batch(self, ids_batch: Iterable[Sequence[int]]) -> list[str]:
    ...

  def save(self, path: str) -> None:
    """Writes a file that `load_tokenizer(path)` reads back."""
    ...


def _content_ids(ids: Sequence[int]) -> list[int]:
  """Ids before the first EOS, without PAD and BOS.

  Decoded model outputs are fixed-length rows: everything after EOS is
  whatever the decoder produced once the sentence had ended.
  """
  out = []
  for i in ids:
    i = int(i)  # numpy rows give np.int32, which SentencePiece rejects.
    if i == EOS_ID:
      break
    if i not in (PAD_ID, BOS_ID):
      out.append(i)
  return out


class WordTokenizer:
  """Whitespace words over a fixed vocabulary; ids 0..3 reserved, words from 4.

  Enough for languages whose vocabulary is known in advance, such as the
  synthetic task, and free of the subword segmentation a test would have to
  reason about.
  """

  def __init__(self, words: Sequence[str]):
    words = list(words)
    for word in words:
      if not word or word.split() != [word]:
        raise ValueError(
            f"WordTokenizer: word {word!r} is empty or contains whitespace; "
            "words are split on whitespace, so it could never be produced."
        )
      if word in RESERVED_TOKENS:
        raise ValueError(
            f"WordTokenizer: word {word!r} is a reserved token; pass only "
            f"real words, the reserved {RESERVED_TOKENS} are added for you."
        )
    self._id_to_token = list(RESERVED_TOKENS) + words
    self._token_to_id = {t: i for i, t in enumerate(self._id_to_token)}
    if len(self._token_to_id) != len(self._id_to_token):
      dupes = sorted({w for w in words if words.count(w) > 1})
      raise ValueError(
          f"WordTokenizer: duplicate words {dupes[:10]}; " "each word needs exactly one id."
      )

  @property
  def vocab_size(self) -> int:
    return len(self._id_to_token)

  @property
  def words(self) -> list[str]:
    """The vocabulary without the reserved tokens, in id order (from id 4)."""
    return self._id_to_token[len(RESERVED_TOKENS) :]

  def encode(self, text: str) -> list[int]:
    return [self._token_to_id.get(w, UNK_ID) for w in text.split()]

  def decode(self, ids: Sequence[int]) -> str:
    return " ".join(self._id_to_token[i] for i in _content_ids(ids))

  def decode_batch(self, ids_batch: Iterable[Sequence[int]]) -> list[str]:
    return [self.decode(ids) for ids in ids_batch]

  def save(self, path: str) -> None:
    """One token per line, line number == id, reserved tokens first."""
    with open(path, "w", encoding="utf-8") as f:
      f.write("\n".join(self._id_to_token) + "\n")

  @classmethod
  def load(cls, path: str, saved: bool = True) -> WordTokenizer:
    """The vocabulary of a file `save` wrote (`saved`: a file without the line end `save` ends
    it with was cut short, and is refused) or of any file of one word per line, reserved tokens
    first. A damaged file is a UserError naming it."""
    with open(path, "rb") as f:
      data = f.read()
    try:
      text = data.decode("utf-8")
    except UnicodeDecodeError as e:
      raise UserError(
          f"{path} is not UTF-8 text (byte {data[e.start]:#04x} at offset {e.start}): {DAMAGED}"
      ) from None
    if not text.strip():
      raise UserError(f"{path} is empty: {DAMAGED}")
    if saved and not text.endswith("\n"):
      raise UserError(
          f"{path} does not end with a line end, as every vocabulary file this project writes "
          f"does: {DAMAGED}"
      )
    tokens = text.splitlines()
    header = tuple(tokens[: len(RESERVED_TOKENS)])
    if header != RESERVED_TOKENS:
      raise UserError(
          f"{path}: expected the first lines to be {RESERVED_TOKENS} (a file "
          f"written by WordTokenizer.save), found {header}. A SentencePiece "
          "'.vocab' file cannot be loaded on its own: pass its '.model' file."
      )
    return cls(tokens[len(RESERVED_TOKENS) :])


class SentencePieceTokenizer:
  """A trained SentencePiece model whose special ids match PAD/EOS/BOS/UNK_ID."""

  def __init__(self, model_path: str):
    if not os.path.exists(model_path):
      raise FileNotFoundError(
          f"SentencePiece model {model_path!r} not found; train one with "
          "train_sentencepiece(...) or check the path."
      )
    try:
      self._sp = spm.SentencePieceProcessor(model_file=model_path)
    except (RuntimeError, OSError) as e:  # a damaged or truncated model proto
      reason = " ".join(str(e).split())
      raise UserError(f"{model_path} is not a SentencePiece model ({reason}): {DAMAGED}") from None
    got = (self._sp.pad_id(), self._sp.eos_id(), self._sp.bos_id(), self._sp.unk_id())
    want = (PAD_ID, EOS_ID, BOS_ID, UNK_ID)
    if got != want:
      # A model with other special ids would silently pad with a real token.
      raise ValueError(
          f"{model_path}: special ids (pad, eos, bos, unk) are {got}, this "
          f"project needs {want}; retrain with train_sentencepiece(...)."
      )

  @property
  def vocab_size(self) -> int:
    return self._sp.get_piece_size()

  def encode(self, text: str) -> list[int]:
    return self._sp.encode(text, out_type=int)

  def encode_batch(self, texts: list[str], num_threads: int = -1) -> list[list[int]]:
    """`encode` of each text, by SentencePiece's C++ threads (-1: one per core)."""
    return self._sp.encode(texts, out_type=int, num_threads=num_threads)

  def decode(self, ids: Sequence[int]) -> str:
    return self._sp.decode(_content_ids(ids))

  def decode_batch(self, ids_batch: Iterable[Sequence[int]]) -> list[str]:
    return self._sp.decode([_content_ids(ids) for ids in ids_batch])

  def save(self, path: str) -> None:
    with open(path, "wb") as f:
      f.write(self._sp.serialized_model_proto())


def train_sentencepiece(
    sentences: Iterable[str],
    model_prefix: str,
    vocab_size: int,
    model_type: str = "bpe",
    max_sentences: int = 5_000_000,
) -> SentencePieceTokenizer:
  """Trains one joint vocabulary and returns it; writes `{model_prefix}.model`.

  Joint, because the paper shares one vocabulary (and one embedding matrix)
  between source and target (§3.4, §5.1): pass sentences of both languages.
  Only the first `max_sentences` are read, bounding the trainer's memory.
  """
  if vocab_size <= len(RESERVED_TOKENS):
    raise ValueError(
        f"vocab_size={vocab_size} leaves no room for pieces "
        f"beyond the {len(RESERVED_TOKENS)} reserved ids."
    )
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(itertools.islice(sentences, max_sentences)),
      model_prefix=model_prefix,
      vocab_size=vocab_size,
      model_type=model_type,
      character_coverage=1.0,  # Keep every character: no UNK for rare letters.
      pad_id=PAD_ID,
      eos_id=EOS_ID,
      bos_id=BOS_ID,
      unk_id=UNK_ID,
      minloglevel=2,  # The trainer's per-step log would drown the training log.
  )
  return SentencePieceTokenizer(model_prefix + ".model")


def load_tokenizer(path: str) -> Tokenizer:
  """SentencePiece for '.model' files, WordTokenizer for '.txt' and '.vocab'."""
  ext = os.path.splitext(path)[1]
  if ext == ".model":
    return SentencePieceTokenizer(path)
  if ext in (".txt", ".vocab"):
    return WordTokenizer.load(path, saved=False)
  raise ValueError(
      f"load_tokenizer: cannot tell the kind of {path!r} from its "
      "extension; use '.model' (SentencePiece) or '.txt'/'.vocab' "
      "(WordTokenizer, one word per line)."
  )
