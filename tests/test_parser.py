"""Plain text to Penn Treebank tokens (tasks/parsing/parser.py), and the parse command's input
read either way. The trees a loaded run gives (nltk.Tree) are checked end to end in
test_parse.py's sample run."""

import io

import pytest

from transformer_jax import errors, parse
from transformer_jax.tasks.parsing import parser

CASES = [
    (
        'The company\'s shares rose 5% (to $3.50) in "heavy" trading.',
        "The company 's shares rose 5 % -LRB- to $ 3.50 -RRB- in `` heavy '' trading .",
    ),
    ('He said, "I can\'t go."', "He said , `` I ca n't go . ''"),
    ("Don't they've 1,000 {braces}?", "Do n't they 've 1,000 -LCB- braces -RCB- ?"),
    ("Mr. Vinken is chairman of Elsevier N.V.", "Mr. Vinken is chairman of Elsevier N.V ."),
]


@pytest.mark.parametrize("text, tokens", CASES)
def test_plain_text_becomes_treebank_tokens(text, tokens):
  assert parser.tokenize(text) == tokens.split()
  assert parser.words_of(text) == tokens.split()  # a string is plain text by default


def test_tokenized_input_is_taken_as_it_is_with_brackets_spelled_as_the_treebank():
  assert parser.words_of("Profits rose ( sharply ) .", tokenized=True) == (
      "Profits rose -LRB- sharply -RRB- .".split()
  )
  assert parser.words_of(["Profits", "rose", "(", "sharply", ")", "."]) == (
      "Profits rose -LRB- sharply -RRB- .".split()
  )


def test_the_parse_command_reads_plain_text_with_tokenize():
  data = "".join(f"{text}\n" for text, _ in CASES).encode()
  plain = parse.read_sentences(io.BytesIO(data), "standard input", 40, tokenize=True)
  assert plain == [tokens.split() for _, tokens in CASES]
  spaced = parse.read_sentences(io.BytesIO(data), "standard input", 40)  # words as given
  assert spaced[1] == 'He said, "I can\'t go."'.split()
  # Counted as tokens: line 1 has 11 words as written, 18 tokens.
  with pytest.raises(errors.UserError, match="standard input line 1 has 18 words; .* at most 12"):
    parse.read_sentences(io.BytesIO(data), "standard input", 12, tokenize=True)
  with pytest.raises(errors.UserError, match="standard input line 2 is empty"):
    parse.read_sentences(io.BytesIO(b"Hi.\n  \n"), "standard input", 8, tokenize=True)
