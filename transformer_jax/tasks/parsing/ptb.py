"""The Penn Treebank source (`config.data.source = "ptb"`): §6.3's parsing task as sentence pairs.

`config.data.path` is a directory searched recursively for `.mrg` files named by their Wall Street
Journal article, `wsj_SSAA.mrg` (section SS, article AA), as in the LDC release
(`.../parsed/mrg/wsj/23/wsj_2300.mrg`) and in NLTK's sample. Each split
(`config.data.train_split`, `eval_split`, `test_split`) is a list of sections or articles:

    "02-21"            sections 02 to 21 (two digits: sections)
    "22"               section 22
    "0001-0159,0170"   articles wsj_0001 to wsj_0159, and wsj_0170 (four digits: articles)

Each tree is read and preprocessed by tasks/parsing/trees.py (empty elements, empty constituents and
function tags removed; a malformed file stops the run before training, naming file and tree) and
becomes a pair: the source is its words joined by spaces, the target its linearization. Trees
with no word left are skipped and counted.

Vocabulary: whole tokens, not subwords, so that brackets and tags are single tokens and the
output is read back token by token (§6.3: "a vocabulary of 16K tokens" for WSJ only): the
reserved ids, every tree token of the training trees, the unknown-word classes seen in training,
then the training words seen at least twice, most frequent first (ties in code-point order), up to
`config.data.vocab_size` ids in all. A word outside the vocabulary is read as its class
(`word_class`: its shape -- digits, capitalized, lower case, other; a hyphen; and its last
`config.parsing.suffix_letters` letters, two by default, which tell `-ly` from `-ed`), or as the
class of a shorter ending (down to two letters) or of the shape alone where the longer one was not
seen twice, or as `<unk>`. Words seen once in training are read as their classes too, which
teaches the model what an unknown word of each class is: part-of-speech tagging of unknown words
by their shape and suffix is the classic treatment of rare words in treebank parsers. Source and
target share the one vocabulary (and the one embedding matrix, §3.4). It is stored in the workdir
as `vocab.txt` (data.tokenizer.WordTokenizer), and a workdir that has one keeps it.

Word dropout (`config.parsing.word_dropout`, a deviation, off by default): in each training batch,
each vocabulary word is read as its class with that probability, in the source and the target
alike (`word_class_table`; train.drop_words), so that the model learns more of what a word's
shape and suffix say than the 3k trees of the sample teach it about each word.

A span chart (`config.parsing.decoder="chart"`, a deviation, off by default) has no decoder: its
targets are each word's row of the tree's chart (chart.targets: the word's tag, the label of its
one-word span and the node its right edge splits), and its vocabulary also holds the unary
chains' labels (`(S+VP`), the classes it scores with the tree tokens (chart.classes).
"""

from __future__ import annotations

import collections
import logging
import os
import re
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from transformer_jax import errors
from transformer_jax import files as files_lib
from transformer_jax.data.tokenizer import RESERVED_TOKENS, WordTokenizer
from transformer_jax.parallel import distributed
from transformer_jax.tasks.parsing import trees

_ARTICLE = re.compile(r"(\d{4})\.mrg$")
MIN_WORD_COUNT = 2  # training words seen fewer times are <unk>


def parse_selection(spec: str, key: str) -> list[tuple[int, int, int]]:
  """`"02-21,0005"` -> [(2, 2, 21), (4, 5, 5)]: (digits, first, last) per item."""
  items = []
  for item in spec.split(","):
    item = item.strip()
    match = re.fullmatch(r"(\d+)(?:-(\d+))?", item)
    if (
        not match
        or len(match.group(1)) not in (2, 4)
        or (match.group(2) and len(match.group(2)) != len(match.group(1)))
    ):
      raise errors.UserError(
          f"config.data.{key}={spec!r}: expected comma-separated sections (two digits, e.g. "
          "'02-21' or '23') or articles (four digits, e.g. '0001-0159'), ranges inclusive"
      )
    first = int(match.group(1))
    last = int(match.group(2) or match.group(1))
    if last < first:
      raise errors.UserError(f"config.data.{key}={spec!r}: the range {item} is empty")
    items.append((len(match.group(1)), first, last))
  return items


def treebank_files(directory: str) -> dict[int, str]:
  """Article number -> path of every `*NNNN.mrg` file under `directory` (recursively)."""
  if not os.path.isdir(directory):
    raise errors.UserError(f"config.data.path={directory!r}: not a directory")
  found: dict[int, str] = {}
  for root, dirs, names in os.walk(directory):
    dirs.sort()
    for name in sorted(names):
      match = _ARTICLE.search(name)
      if not match:
        continue
      article, path = int(match.group(1)), os.path.join(root, name)
      if article in found:
        raise errors.UserError(
            f"config.data.path={directory!r}: article {article:04d} is there twice, "
            f"{found[article]} and {path}; point data.path at one copy of the treebank"
        )
      found[article] = path
  if not found:
    raise errors.UserError(
        f"config.data.path={directory!r}: no treebank file in it (expected .mrg files named "
        "by article, e.g. wsj_0001.mrg, as in the Penn Treebank's parsed/mrg/wsj/NN/)"
    )
  return found


def select_files(files: dict[int, str], spec: str, key: str) -> list[str]:
  """The paths of the articles `spec` names, in article order."""
  items = parse_selection(spec, key)
  chosen = [
      path
      for article, path in sorted(files.items())
      if any(
          first <= (article // 100 if digits == 2 else article) <= last
          for digits, first, last in items
      )
  ]
  if not chosen:
    sections = sorted({a // 100 for a in files})
    raise errors.UserError(
        f"config.data.{key}={spec!r} selects no file of the {len(files)} treebank files "
        f"(articles {min(files):04d}-{max(files):04d}, sections "
        f"{', '.join(f'{s:02d}' for s in sections)})"
    )
  return chosen


def load_trees(paths: Sequence[str]) -> tuple[list[trees.Tree], int]:
  """The preprocessed trees of `paths`, in order, and how many had no word left."""
  out, empty = [], 0
  for path in paths:
    for tree in trees.read_trees(path):
      kept = trees.preprocess(tree)
      if kept is None:
        empty += 1
      else:
        out.append(kept)
  return out, empty


def word_class(word: str, suffix_letters: int = 2) -> tuple[str, ...]:
  """The unknown-word classes of `word`, finest first: its shape with its last `suffix_letters`
  letters, then with fewer (down to two), then its shape alone. `<unk:low:ed>`, `<unk:low>` for
  'fizzled'; `<unk:low:led>`, `<unk:low:ed>`, `<unk:low>` with `suffix_letters=3`. A suffix of k
  letters is kept for words of more than k + 1 letters, capitalized or lower case."""
  if any(c.isdigit() for c in word):
    shape = "num"
  elif word[:1].isupper():
    shape = "cap"
  elif any(c.isalpha() for c in word):
    shape = "low"
  else:
    shape = "sym"
  if "-" in word:
    shape += "-"
  coarse = f"<unk:{shape}>"
  if not shape.startswith(("cap", "low")):
    return (coarse,)
  endings = range(min(suffix_letters, len(word) - 2), 1, -1)  # k letters need len(word) > k + 1
  return (*(f"<unk:{shape}:{word[-k:].lower()}>" for k in endings), coarse)


def encode_words(
    tokenizer: WordTokenizer, known: set[str], words: Sequence[str], suffix_letters: int = 2
) -> list[int]:
  """Token ids of a sentence's words: a word, else its finest class in the vocabulary, else
  `<unk>` (module docstring); tree tokens (a target's brackets and tags) are taken as they are.

  `known` is `set(tokenizer.words)`, made once by the caller."""
  out = [
      w if w in known or trees.is_tree_token(w) else _class_token(w, known, suffix_letters)
      for w in words
  ]
  return tokenizer.encode(" ".join(out))


def _class_token(word: str, known: set[str], suffix_letters: int) -> str:
  """The class `word` is read as when the vocabulary lacks it: its finest class the vocabulary
  has, else its shape's (which the tokenizer reads as `<unk>` if it does not know that either)."""
  classes = word_class(word, suffix_letters)
  return next((c for c in classes if c in known), classes[-1])


def word_class_table(tokenizer: WordTokenizer, suffix_letters: int = 2) -> np.ndarray:
  """[v] int32: each vocabulary word's id -> the id of the class a word outside the vocabulary
  would be read as (its finest class in the vocabulary, else `<unk>`, as `encode_words`);
  reserved ids, tree tokens and the classes themselves -> themselves. What word dropout
  (`config.parsing.word_dropout`) replaces a word with."""
  known = set(tokenizer.words)
  table = np.arange(tokenizer.vocab_size, dtype=np.int32)
  for index, word in enumerate(tokenizer.words, start=len(RESERVED_TOKENS)):
    if not trees.is_tree_token(word) and not word.startswith("<unk"):  # a word, not a class
      table[index] = tokenizer.encode(_class_token(word, known, suffix_letters))[0]
  return table


def build_vocabulary(
    train: Sequence[trees.Tree],
    closing: str,
    vocab_size: int,
    suffix_letters: int = 2,
    chains: bool = False,
) -> WordTokenizer:
  """Reserved ids, tree tokens, unknown-word classes, then frequent words (module docstring).
  `chains`: the tree tokens include the unary chains' openings (chart.chain_tokens), the labels
  a span chart predicts (`config.parsing.decoder="chart"`)."""
  tree_tokens = set(trees.iter_tree_tokens(train, closing))
  if chains:
    from transformer_jax.tasks.parsing import chart

    tree_tokens.update(chart.chain_tokens(train))
  tree_tokens = sorted(tree_tokens)
  counts = collections.Counter(word for tree in train for word in tree.words())
  frequent = sorted(
      (w for w, c in counts.items() if c >= MIN_WORD_COUNT and w not in RESERVED_TOKENS),
      key=lambda w: (-counts[w], w),
  )
  classes = collections.Counter()
  for word, count in counts.items():
    if count < MIN_WORD_COUNT:
      for token in word_class(word, suffix_letters):
        classes[token] += count
  class_tokens = sorted(t for t, c in classes.items() if c >= MIN_WORD_COUNT)
  room = vocab_size - len(RESERVED_TOKENS) - len(tree_tokens) - len(class_tokens)
  if room < 0:
    raise errors.UserError(
        f"config.data.vocab_size={vocab_size} is smaller than the {len(tree_tokens)} tree "
        f"tokens and {len(class_tokens)} unknown-word classes of the training trees plus "
        f"{len(RESERVED_TOKENS)} reserved ids"
    )
  return WordTokenizer(tree_tokens + class_tokens + frequent[:room])


def load_splits(
    config: ml_collections.ConfigDict, vocab_path: str | None, splits: Sequence[str]
) -> tuple[WordTokenizer, dict[str, tuple[list[tuple[str, str]], list]]]:
  """The vocabulary (read from `vocab_path` if it exists, else made from train and written
  there) and, for each of `splits`, its (sentence, linearized tree) pairs and their token ids."""
  d = config.data
  files = treebank_files(d.path)
  names = {"train": d.train_split, "eval": d.eval_split, "test": d.test_split}
  loaded = {}
  for key in dict.fromkeys(["train", *splits]):
    tree_list, empty = load_trees(select_files(files, names[key], f"{key}_split"))
    if empty:
      logging.info("data: %s split: skipped %d trees with no word but empty elements", key, empty)
    loaded[key] = tree_list
  linearization = trees.Linearization.from_config(config.parsing)
  p = config.parsing
  letters = p.suffix_letters
  chart_targets = p.decoder == "chart"
  if vocab_path and os.path.exists(vocab_path):
    tokenizer = WordTokenizer.load(vocab_path)
    logging.info("data: reusing the vocabulary in %s", vocab_path)
  else:
    tokenizer = build_vocabulary(
        loaded["train"], linearization.closing, d.vocab_size, letters, chains=chart_targets
    )
    if vocab_path and distributed.is_chief():
      files_lib.atomic_write(vocab_path, tokenizer.save)
  known = set(tokenizer.words)
  if chart_targets:
    from transformer_jax.tasks.parsing import chart

    labels, tags = chart.classes(tokenizer.words)
    label_index = {label: i for i, label in enumerate(labels)}
    tag_index = {tag: i for i, tag in enumerate(tags)}
  out = {}
  for key in splits:
    pairs = [(" ".join(tree.words()), " ".join(linearization.tokens(tree))) for tree in loaded[key]]
    sources = [encode_words(tokenizer, known, s.split(), letters) for s, _ in pairs]
    if chart_targets:  # each word's row of the chart's targets (chart.targets)
      targets = [chart.targets(tree, label_index, tag_index) for tree in loaded[key]]
    else:  # a target's words (parsing.tree_words) are read as the source's; tree tokens as they are
      targets = [encode_words(tokenizer, known, t.split(), letters) for _, t in pairs]
    out[key] = (pairs, list(zip(sources, targets)))
  return tokenizer, out


WORD_KEYS = ("inputs", "decoder_inputs", "targets")  # the token ids of a batch


def drop_words(
    batch: dict, rng: jax.Array, rate: float, classes, keys: Sequence[str] = WORD_KEYS
) -> dict:
  """Word dropout (`config.parsing.word_dropout`): each vocabulary word is read,
  everywhere in this batch, as its class `classes[id]` with probability `rate`. By word rather
  than by occurrence, so that a target's copy of a word stays the source's."""
  vocab = classes.shape[0]
  dropped = jax.random.bernoulli(rng, rate, (vocab,))  # [v]
  table = jnp.where(dropped, classes, jnp.arange(vocab, dtype=classes.dtype))  # [v]

  return {k: table[v] if k in keys else v for k, v in batch.items()}  # [b, L] ids
