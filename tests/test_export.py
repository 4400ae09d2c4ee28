"""Export to CTranslate2: an engine no one here wrote reproduces the model from its weights.

For every model variant the configs can express and CTranslate2 can hold, on random parameters
(default suite) and on briefly trained runs (slow): CTranslate2's `score_batch` log-probabilities
equal the model's teacher-forced ones within 1e-4, and its greedy translations are token for
token the project's, on 200 sentences. The variant it cannot hold (d_k != d_v) and bad command
input are refused with one line.

The project's search never emits PAD or BOS (decode.py) and may emit EOS first; CTranslate2 is
told the same (`suppress_sequences`, `min_decoding_length=0`: `SEARCH_AS_THE_PROJECT`).
"""

import ast
import contextlib
import io
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sacrebleu
from testing import random_params, tiny_train_config

from transformer_jax import errors
from transformer_jax.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, RESERVED_TOKENS
from transformer_jax.model.config import TransformerConfig
from transformer_jax.model.transformer import Transformer
from transformer_jax.serving import ctranslate2_model

ctranslate2 = pytest.importorskip("ctranslate2")

REPO = pathlib.Path(__file__).resolve().parents[1]
TOLERANCE = 1e-4  # log-probabilities, float32
SEARCH_AS_THE_PROJECT = {
    "suppress_sequences": [[RESERVED_TOKENS[PAD_ID]], [RESERVED_TOKENS[BOS_ID]]],
    "min_decoding_length": 0,
}

# Every variant of the model a config can express, as TransformerConfig fields; each exports.
VARIANTS = {
    "post_ln": {},
    "pre_ln": {"norm_position": "pre"},  # with the final norm of each stack
    "learned_positions": {"positional": "learned"},  # Table 3 row E
    "separate_embeddings": {"share_embeddings": False},
    "decoder_layers_differ": {"num_decoder_layers": 3},
    "head_dim_not_d_model_over_h": {"key_dim": 6, "value_dim": 6},  # d_model/h = 8
    "scan_layers": {"scan_layers": True},
    "bfloat16_params": {"param_dtype": "bfloat16"},
    # A large ε: the exported model must use the model's ε, not CTranslate2's default.
    "layer_norm_epsilon": {"layer_norm_epsilon": 0.5},
}

WORDS = [f"w{i}" for i in range(40)]
VOCAB = list(RESERVED_TOKENS) + WORDS


def tiny_config(**fields) -> TransformerConfig:
  base = dict(vocab_size=len(VOCAB), d_model=16, num_heads=2, num_layers=2, d_ff=32, max_len=24)
  return TransformerConfig(**{**base, **fields}, deterministic=True)


@pytest.fixture(scope="module")
def vocab_file(tmp_path_factory) -> str:
  path = tmp_path_factory.mktemp("vocab") / "vocab.txt"
  path.write_text("\n".join(VOCAB) + "\n")
  return str(path)


def random_sentences(rng, count: int, max_tokens: int) -> list[list[int]]:
  """Token ids (UNK included, never PAD, EOS or BOS), 1..max_tokens of them."""
  return [
      rng.integers(3, len(VOCAB), rng.integers(1, max_tokens + 1)).tolist() for _ in range(count)
  ]


def pad(rows: list[list[int]], width: int) -> np.ndarray:
  out = np.full((len(rows), width), PAD_ID, np.int32)
  for i, row in enumerate(rows):
    out[i, : len(row)] = row
  return out


def as_tokens(ids) -> list[str]:
  return [VOCAB[i] for i in ids]


def teacher_forced_log_probs(model_config, params, sources, targets) -> list[np.ndarray]:
  """log p(y_t | y_<t, x) of each target token and of the final EOS, from the model's forward
  pass: source + EOS in, BOS + target as decoder input (data/batching.py's layout)."""
  inputs = pad([s + [EOS_ID] for s in sources], max(map(len, sources)) + 1)
  decoder_inputs = pad([[BOS_ID] + t for t in targets], max(map(len, targets)) + 1)
  labels = pad([t + [EOS_ID] for t in targets], decoder_inputs.shape[1])
  logits = jax.jit(Transformer(model_config).apply)({"params": params}, inputs, decoder_inputs)
  log_probs = np.asarray(jax.nn.log_softmax(logits, axis=-1))  # [b, t, v]
  chosen = np.take_along_axis(log_probs, labels[..., None], axis=-1)[..., 0]  # [b, t]
  return [chosen[i, : len(t) + 1] for i, t in enumerate(targets)]


def reference_greedy(model_config, params, sources, steps: int) -> list[list[int]]:
  """Greedy search by the model's full forward pass, one position per call: the argmax of each
  next-token distribution with PAD and BOS ruled out (as decode.py rules them out), for `steps`
  steps or until EOS. Returns the tokens before EOS."""
  inputs = pad([s + [EOS_ID] for s in sources], max(map(len, sources)) + 1)
  apply = jax.jit(Transformer(model_config).apply)
  decoder_inputs = np.zeros((len(sources), steps), np.int32)  # [b, steps]
  decoder_inputs[:, 0] = BOS_ID
  out = np.zeros_like(decoder_inputs)
  for t in range(steps):
    logits = np.array(apply({"params": params}, inputs, decoder_inputs)[:, t])  # [b, v]
    logits[:, [PAD_ID, BOS_ID]] = -np.inf
    out[:, t] = logits.argmax(-1)
    if t + 1 < steps:
      decoder_inputs[:, t + 1] = out[:, t]
  hypotheses = []
  for row in out.tolist():
    hypotheses.append(row[: row.index(EOS_ID)] if EOS_ID in row else row)
  return hypotheses


def assert_scores_equal(
    translator, model_config, params, sources, targets, vocab=VOCAB, tolerance=TOLERANCE
):
  """score_batch's log-probabilities of (sources, targets) (ids of the tokens `vocab`) are the
  model's teacher-forced ones, to `tolerance`."""
  results = translator.score_batch(
      [[vocab[i] for i in s] for s in sources], [[vocab[i] for i in t] for t in targets]
  )
  ours = teacher_forced_log_probs(model_config, params, sources, targets)
  worst = 0.0
  for result, expected in zip(results, ours):
    assert len(result.log_probs) == len(expected)  # the target's tokens and EOS
    worst = max(worst, float(np.max(np.abs(np.asarray(result.log_probs) - expected))))
  assert worst < tolerance, f"largest log-probability difference {worst:.3g}"


@pytest.mark.slow  # 10-60 s on 2 cores: .ci/run runs it after the default suite
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_random_model_scores_and_greedy_translations_equal_the_projects(
    variant, vocab_file, tmp_path
):
  model_config = tiny_config(**VARIANTS[variant])
  params = random_params(model_config, seed=1)
  output = ctranslate2_model.export_ctranslate2(
      model_config, params, vocab_file, str(tmp_path / "ct2")
  )
  assert sorted(os.listdir(output)) == ["config.json", "model.bin", "shared_vocabulary.json"]
  translator = ctranslate2.Translator(output, device="cpu", intra_threads=1)
  rng = np.random.default_rng(0)
  sources = random_sentences(rng, 200, model_config.max_len - 1)
  targets = random_sentences(rng, 200, model_config.max_len - 1)
  assert_scores_equal(translator, model_config, params, sources, targets)

  steps = model_config.max_len  # the whole position table
  ours = reference_greedy(model_config, params, sources, steps)
  theirs = translator.translate_batch(
      [as_tokens(s) for s in sources], beam_size=1, max_decoding_length=steps,
      **SEARCH_AS_THE_PROJECT,
  )  # fmt: skip
  different = [i for i, r in enumerate(theirs) if r.hypotheses[0] != as_tokens(ours[i])]
  assert not different, f"{len(different)} of 200 greedy translations differ, e.g. {different[:5]}"


def test_beam_score_is_log_probability_over_length_to_the_penalty(vocab_file, tmp_path):
  """What CTranslate2's beam search ranks by (decoding.cc, `finalize_hypothesis_score`):
  log P(Y) / |Y|^length_penalty, |Y| counting EOS (which the hypothesis returned leaves out)
  and log P(Y) including EOS's. The project's §6.1 GNMT penalty divides by ((5 + |Y|) / 6)^α,
  |Y| also with EOS (search.length_penalty): no length_penalty makes one the other, so the two
  beam searches rank hypotheses differently."""
  model_config = tiny_config()
  params = random_params(model_config, seed=2)
  output = ctranslate2_model.export_ctranslate2(
      model_config, params, vocab_file, str(tmp_path / "ct2")
  )
  translator = ctranslate2.Translator(output, device="cpu", intra_threads=1)
  sources = random_sentences(np.random.default_rng(3), 60, 10)
  for penalty in (0.0, 0.6, 1.0):
    # No suppressed tokens here: CTranslate2 renormalizes the log-probabilities over the tokens
    # it allows (the project's search does not), and score_batch suppresses none.
    results = translator.translate_batch(
        [as_tokens(s) for s in sources], beam_size=4, length_penalty=penalty, return_scores=True,
        max_decoding_length=model_config.max_len, min_decoding_length=0,
    )  # fmt: skip
    # Those that ended with EOS (not at the length limit: score_batch would add an EOS).
    ended = [
        (s, r) for s, r in zip(sources, results) if len(r.hypotheses[0]) < model_config.max_len
    ]
    assert len(ended) >= 5
    hypotheses = [r.hypotheses[0] for _, r in ended]
    scored = translator.score_batch([as_tokens(s) for s, _ in ended], hypotheses)
    for (_, result), hypothesis, score in zip(ended, hypotheses, scored):
      expected = sum(score.log_probs) / (len(hypothesis) + 1) ** penalty
      assert result.scores[0] == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize("quantization", ["float16", "bfloat16", "int8"])
def test_quantized_exports_hold_rounded_weights(quantization, vocab_file, tmp_path):
  """float16/bfloat16 exports hold the weights rounded to that type (CTranslate2 computes in
  float32 on a CPU without them: the scores are then the model's with rounded weights; learned
  positions, so that the position table is a weight too); int8 matrices take a quarter of the
  bytes and score close to float32."""
  model_config = tiny_config(positional="learned")
  params = random_params(model_config, seed=4)
  full = ctranslate2_model.export_ctranslate2(
      model_config, params, vocab_file, str(tmp_path / "f32")
  )
  small = ctranslate2_model.export_ctranslate2(
      model_config, params, vocab_file, str(tmp_path / quantization), quantization
  )
  ratio = os.path.getsize(f"{small}/model.bin") / os.path.getsize(f"{full}/model.bin")
  rng = np.random.default_rng(5)
  sources, targets = random_sentences(rng, 50, 12), random_sentences(rng, 50, 12)
  translator = ctranslate2.Translator(small, device="cpu", compute_type="float32")
  if quantization == "int8":
    assert 0.25 < ratio < 0.5  # int8 matrices; float32 positions, LayerNorms, biases, scales
    assert_scores_equal(translator, model_config, params, sources, targets, tolerance=0.5)
    return
  assert 0.45 < ratio < 0.55
  rounded = jax.tree.map(lambda x: jnp.asarray(x, quantization).astype(jnp.float32), params)
  assert_scores_equal(translator, model_config, rounded, sources, targets)


@pytest.mark.slow  # a SentencePiece export: .ci/run runs it after the default suite
def test_docs_page_example_translates_with_a_sentencepiece_export(tmp_path):
  """A SentencePiece vocabulary (Multi30k's and WMT's kind) exports with its model file, scores
  as the model on its pieces, and the example of docs/export.md translates with it as it is
  written."""
  from transformer_jax.data import synthetic
  from transformer_jax.data.tokenizer import train_sentencepiece

  pairs = synthetic.SyntheticTask(num_train=300, num_valid=0, num_test=0).pairs("train")
  tokenizer = train_sentencepiece(
      (s for pair in pairs for s in pair), str(tmp_path / "vocab"), vocab_size=100
  )
  vocab_path = str(tmp_path / "vocab.model")
  model_config = tiny_config(vocab_size=100, max_len=256)  # the example decodes up to 256
  params = random_params(model_config, seed=6)
  output = ctranslate2_model.export_ctranslate2(
      model_config, params, vocab_path, str(tmp_path / "OUT")
  )
  assert ctranslate2_model.SENTENCEPIECE_FILE in os.listdir(output)
  sources = [tokenizer.encode(s) for s, _ in pairs[:50]]
  targets = [tokenizer.encode(t) for _, t in pairs[:50]]
  translator = ctranslate2.Translator(output, device="cpu", intra_threads=1)
  vocab = ctranslate2_model.vocabulary_tokens(vocab_path)
  assert_scores_equal(translator, model_config, params, sources, targets, vocab)

  page = (REPO / "docs" / "export.md").read_text()
  example = page[page.index("## Export and serve") :].split("```python\n", 1)[1]
  example = example.split("```", 1)[0].replace('"OUT', f'"{output}')
  printed = io.StringIO()
  with contextlib.redirect_stdout(printed):
    exec(example, {})  # noqa: S102 - the docs page's own code
  translations = ast.literal_eval(printed.getvalue())
  assert len(translations) == 1 and isinstance(translations[0], str)


def test_d_k_different_from_d_v_is_refused_naming_the_variant(vocab_file, tmp_path):
  model_config = tiny_config(key_dim=4)  # Table 3 row B: d_k 4, d_v = d_model / h = 8
  with pytest.raises(
      ctranslate2_model.ExportError, match=r"key_dim=4 != model.value_dim=8 .*Table 3 row B"
  ):
    ctranslate2_model.export_ctranslate2(
        model_config, random_params(model_config), vocab_file, str(tmp_path / "new")
    )
  assert not (tmp_path / "new").exists() and os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(relative_positions=4), "relative_positions=4.*cannot be"),
    ],
)
def test_a_model_ctranslate2_has_no_place_for_is_refused(fields, message, vocab_file, tmp_path):
  model_config = tiny_config(**fields)
  with pytest.raises(ctranslate2_model.ExportError, match=message):
    ctranslate2_model.export_ctranslate2(
        model_config, random_params(model_config), vocab_file, str(tmp_path / "new")
    )
  assert not (tmp_path / "new").exists()


def test_export_of_a_d_k_d_v_run_is_refused_from_its_config_before_any_checkpoint(tmp_path):
  config = tiny_train_config()
  config.model.key_dim = 4  # Table 3 row B: d_v stays d_model / h = 8
  (tmp_path / "config.json").write_text(config.to_json_best_effort())  # as train.py writes it
  with pytest.raises(ctranslate2_model.ExportError, match="key_dim=4 != model.value_dim=8"):
    ctranslate2_model.export_run(
        str(tmp_path), str(tmp_path / "out")
    )  # no vocabulary, no checkpoint yet
  assert not (tmp_path / "out").exists()


def test_vocabulary_without_the_projects_special_tokens_is_refused(tmp_path):
  path = tmp_path / "vocab.txt"
  path.write_text("\n".join(["<pad>", "<s>", "</s>", "<unk>"] + WORDS) + "\n")  # BOS/EOS swapped
  with pytest.raises(
      ctranslate2_model.ExportError, match=r"id 1 \(eos\) is '<s>', expected '</s>'"
  ):
    ctranslate2_model.vocabulary_tokens(str(path))


def test_bad_output_and_quantization_are_refused_before_any_work(vocab_file, tmp_path):
  model_config = tiny_config()
  params = random_params(model_config)
  cases = {
      str(tmp_path / "missing" / "out"): "does not exist",
      str(tmp_path): "exists; remove it",
  }
  for output, message in cases.items():
    with pytest.raises(errors.UserError, match=message):
      ctranslate2_model.export_ctranslate2(model_config, params, vocab_file, output)
  with pytest.raises(errors.UserError, match="--quantization='int4': expected one of float32"):
    ctranslate2_model.export_ctranslate2(
        model_config, params, vocab_file, str(tmp_path / "x"), "int4"
    )
  with pytest.raises(errors.UserError, match="--workdir=.* is not a directory"):
    ctranslate2_model.export_run(str(tmp_path / "no_run"), str(tmp_path / "y"))
  with pytest.raises(errors.UserError, match="--format='onnx'"):
    ctranslate2_model.export_run(str(tmp_path), str(tmp_path / "y"), export_format="onnx")


# ----------------------------------------------------------------------------- trained runs


def train_run(workdir, num_steps: int, **model_fields):
  """A tiny run on the synthetic task (tests/testing.py), `num_steps` steps."""
  from transformer_jax.training import train

  config = tiny_train_config()
  config.train.num_steps = num_steps
  config.train.checkpoint_every = num_steps
  # Settings that teach this tiny model to end its sentences within 100 steps (test BLEU ~9).
  config.train.warmup_steps = 30
  config.train.lr_multiplier = 1.0
  config.data.synthetic_train_size = 2000
  config.data.tokens_per_batch = 1024
  config.model.dropout_rate = 0.0
  for key, value in model_fields.items():
    config.model[key] = value
  train.run(config, str(workdir), devices=jax.devices()[:1])
  return config


def unseen_pairs(config, count: int) -> list[tuple[str, str]]:
  """`count` synthetic pairs the run never saw: the ones after its test, valid and train pairs."""
  from transformer_jax.data import synthetic

  d = config.data
  seen = d.synthetic_train_size + 2 * d.synthetic_eval_size
  task = synthetic.SyntheticTask(d.synthetic_seed, num_train=0, num_valid=0, num_test=seen + count)
  return task.pairs("test")[seen:]


def check_exported_run(workdir, output, config, beam_bleu_gap: float | None = None) -> dict:
  """The export of `workdir`'s run scores as its model and translates greedily as its own
  decoder (inference.py), on 200 unseen sentences; with `beam_bleu_gap`, beam 4 of both engines
  (each with its own length penalty) is within that many BLEU points."""
  from transformer_jax.runs import inference

  run = inference.load_run(str(workdir))
  pairs = unseen_pairs(config, 200)
  sources = [run.tokenizer.encode(s) for s, _ in pairs]
  targets = [run.tokenizer.encode(t) for _, t in pairs]
  translator = ctranslate2.Translator(str(output), device="cpu", intra_threads=1)
  model_config = run.model_config.replace(deterministic=True)
  vocab = ctranslate2_model.vocabulary_tokens(str(pathlib.Path(workdir) / "vocab.txt"))
  assert_scores_equal(translator, model_config, run.params, sources, targets, vocab)

  # decode.py stops each sentence at its own limit (ctranslate2_model.output_limit);
  # CTranslate2 takes one
  # limit per call, so the sentences of one limit are translated together.
  source_tokens = [s.split() for s, _ in pairs]
  limits = [
      ctranslate2_model.output_limit(len(ids), config.eval.max_decode_extra, model_config.max_len)
      for ids in sources
  ]

  def ctranslate2_outputs(**kwargs) -> list[str]:
    out = [""] * len(pairs)
    for limit in sorted(set(limits)):
      rows = [i for i, n in enumerate(limits) if n == limit]
      results = translator.translate_batch(
          [source_tokens[i] for i in rows],
          max_decoding_length=limit,
          **SEARCH_AS_THE_PROJECT,
          **kwargs,
      )
      for i, r in zip(rows, results):
        out[i] = " ".join(r.hypotheses[0])
    return out

  ours = run.decode_ids(sources, beam_size=1)
  theirs = ctranslate2_outputs(beam_size=1)
  different = [i for i in range(len(pairs)) if ours[i] != theirs[i]]
  assert not different, f"{len(different)} of 200 greedy translations differ: {different[:5]}"
  result = {"greedy_identical": len(pairs) - len(different)}
  if beam_bleu_gap is not None:
    references = [t for _, t in pairs]
    ours = run.decode_ids(sources, beam_size=4, alpha=0.6)
    theirs = ctranslate2_outputs(beam_size=4, length_penalty=1.0)
    result["beam4_bleu"] = [sacrebleu.corpus_bleu(h, [references]).score for h in (ours, theirs)]
    result["beam4_identical"] = sum(a == b for a, b in zip(ours, theirs))
    assert abs(result["beam4_bleu"][0] - result["beam4_bleu"][1]) <= beam_bleu_gap, result
  return result


# d_model 64: the smallest of these widths that learns to end its sentences in 100 steps.
TRAINED = {"d_model": 64, "d_ff": 128}


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
  """A post-LN run of 100 steps: about 10 s of training on a CPU, 30 s with compilation and
  its final evaluation (so the tests that use it are slow or start processes)."""
  workdir = tmp_path_factory.mktemp("run")
  return workdir, train_run(workdir, 100, **TRAINED)


@pytest.mark.slow
def test_export_of_a_trained_run_scores_and_translates_as_the_run(trained_run, tmp_path):
  workdir, config = trained_run
  info = ctranslate2_model.export_run(str(workdir), str(tmp_path / "ct2"), "latest")
  assert info["checkpoint"] == "step 100" and info["tokens"] == "whitespace words"
  result = check_exported_run(workdir, tmp_path / "ct2", config, beam_bleu_gap=3.0)
  print("post_ln", result)
  assert result["beam4_bleu"][0] > 1.0, result  # it learned something: the comparison means it


@pytest.mark.subprocess
def test_export_command_writes_a_model_and_reports_bad_input_in_one_line(trained_run, tmp_path):
  workdir, _ = trained_run

  def export_command(*args):
    return subprocess.run(
        [sys.executable, "-m", "transformer_jax.export", *args],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip

  out = tmp_path / "int8"
  done = export_command(f"--workdir={workdir}", f"--output={out}", "--quantization=int8")
  assert done.returncode == 0, done.stderr[-2000:]
  assert (out / "model.bin").exists() and (out / "export.json").exists()
  bad = {
      "--workdir": ([f"--workdir={tmp_path / 'none'}", f"--output={tmp_path / 'a'}"], "workdir"),
      "--output": ([f"--workdir={workdir}", f"--output={tmp_path / 'no' / 'a'}"], "does not exist"),
      "--quantization": (
          [f"--workdir={workdir}", f"--output={tmp_path / 'b'}", "--quantization=int4"],
          "int4",
      ),
  }
  for flag, (args, message) in bad.items():
    failed = export_command(*args)
    lines = failed.stderr.strip().splitlines()
    assert failed.returncode == 1 and lines, flag
    assert lines[-1].startswith(f"error: {flag}") and message in lines[-1], (flag, lines[-3:])
    assert "Traceback" not in failed.stderr, flag
  refused = tmp_path / "row_b"  # a run of a variant CTranslate2 cannot hold: its config suffices
  refused.mkdir()
  config = tiny_train_config()
  config.model.key_dim = 4
  (refused / "config.json").write_text(config.to_json_best_effort())
  failed = export_command(f"--workdir={refused}", f"--output={tmp_path / 'c'}")
  lines = failed.stderr.strip().splitlines()
  assert failed.returncode == 1 and "Traceback" not in failed.stderr
  assert lines[-1].startswith("error: model.key_dim=4 != model.value_dim=8 (d_k != d_v, Table 3")


@pytest.mark.subprocess
def test_decode_benchmark_times_both_engines_on_the_same_sentences(trained_run, tmp_path):
  workdir, config = trained_run
  sources = tmp_path / "sources.txt"
  sources.write_text("".join(s + "\n" for s, _ in unseen_pairs(config, 24)))
  args = [
      f"--workdir={workdir}", f"--input={sources}", "--engines=jax,ctranslate2",
      "--quantizations=float32,int8", "--repeats=1", "--beam_size=2", "--batch_tokens=256",
      "--threads=1", "--beam_stops=proven,k_finished", "--matmul_dtypes=bfloat16", "--refill=on",
  ]  # fmt: skip
  one_device = os.environ["XLA_FLAGS"].replace("--xla_force_host_platform_device_count=8", "")
  done = subprocess.run(
      [sys.executable, "benchmarks/decode.py", *args],
      cwd=REPO, capture_output=True, text=True, timeout=600,
      env={**os.environ, "XLA_FLAGS": one_device},  # one CPU device: greedy refills its rows
  )  # fmt: skip
  assert done.returncode == 0, done.stderr[-3000:]
  result = json.loads(done.stdout.strip().splitlines()[-1])
  ct2 = result["ctranslate2"]
  assert ct2["threads"] == 1 and ct2["length_penalty"] == 1.0
  assert ct2["device"] == "cpu"  # auto: JAX runs on the CPU here
  for quantization in ("float32", "int8"):
    for mode in ("greedy", "beam2"):
      r = ct2[quantization][mode]
      assert r["sentences"] == result[mode]["sentences"] == 24 and r["sentences_per_s"] > 0
      assert 0 <= r["identical_to_jax"] <= 24
  assert ct2["float32"]["greedy"]["identical_to_jax"] == 24  # the same model, the same search
  # Greedy refilled its rows (decoding/refill.py), and in batches gave the same translations.
  assert result["devices"] == 1 and result["greedy_batches"]["identical_to_greedy"] == 24
  assert result["greedy"]["rows"] <= 256 and result["greedy"]["batches"] == 2  # chunks of 16
  # The beam once per stop rule, the second against the first; CTranslate2's against both.
  stopped = result["beam2_k_finished"]
  assert stopped["sentences"] == 24 and 0 <= stopped["identical_to_proven"] <= 24
  assert stopped["steps"] <= result["beam2"]["steps"]  # it stops no later
  assert 0 <= ct2["float32"]["beam2"]["identical_to_jax_k_finished"] <= 24
  assert result["beam2_k_finished_over_greedy_time"] > 0
  # The layers' matmuls in bfloat16 (eval.matmul_dtype): each mode against its float32 twin.
  for mode, twin in (
      ("greedy_bfloat16", "identical_to_greedy"),
      ("beam2_bfloat16", "identical_to_proven"),
      ("beam2_k_finished_bfloat16", "identical_to_proven"),  # both deviations at once
  ):
    assert result[mode]["sentences"] == 24 and 0 <= result[mode][twin] <= 24
  assert result["beam2_k_finished_bfloat16"]["steps"] <= result["beam2_bfloat16"]["steps"]
  failed = subprocess.run(
      [sys.executable, "benchmarks/decode.py", f"--workdir={workdir}", "--engines=jax,onnx"],
      cwd=REPO, capture_output=True, text=True, timeout=300,
  )  # fmt: skip
  assert failed.returncode == 1
  assert failed.stderr.strip().splitlines()[-1].startswith("error: --engines=jax,onnx")
  if not ctranslate2.get_cuda_device_count():  # a CUDA device asked for where there is none
    failed = subprocess.run(
        [sys.executable, "benchmarks/decode.py", f"--workdir={workdir}", *args[1:3],
         "--ct2_device=cuda"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert failed.returncode == 1
    last = failed.stderr.strip().splitlines()[-1]
    assert last == "error: --ct2_device=cuda: CTranslate2 sees no CUDA device", last
    assert '"greedy"' not in failed.stdout  # refused before any decoding


@pytest.mark.subprocess
def test_accelerator_script_decode_row_times_both_engines(trained_run, tmp_path):
  """benchmarks/accelerator.sh, the script a lent GPU runs: its decode row records the
  project's and CTranslate2's figures (here on the CPU) and prints a line for each."""
  workdir, config = trained_run
  sources = tmp_path / "sources.txt"
  sources.write_text("".join(s + "\n" for s, _ in unseen_pairs(config, 12)))
  env = {
      **os.environ, "ROWS": "decode", "RUN": str(workdir), "DECODE_INPUT": str(sources),
      "DECODE_CHECKPOINT": "latest", "DECODE_BATCH_TOKENS": "256",
      "DECODE_QUANTIZATIONS": "float32",
  }  # fmt: skip
  out = tmp_path / "out"
  done = subprocess.run(
      ["bash", "benchmarks/accelerator.sh", str(out)],
      cwd=REPO, capture_output=True, text=True, timeout=600, env=env,
  )  # fmt: skip
  assert done.returncode == 0, done.stderr[-3000:]
  [line] = (out / "results.jsonl").read_text().splitlines()
  row = json.loads(line)
  assert row["name"] == "decode" and row["rc"] == 0, (out / "errors.log").read_text()
  result = row["result"]
  assert result["greedy"]["sentences"] == result["beam4"]["sentences"] == 12
  ct2 = result["ctranslate2"]
  assert ct2["device"] == "cpu" and set(ct2) >= {"float32"}
  assert ct2["float32"]["greedy"]["identical_to_jax"] == 12  # the same model, the same search
  lines = done.stdout.splitlines()
  assert lines[0].startswith("decode: greedy ") and "sentences/s" in lines[0], done.stdout
  assert lines[1].startswith("decode, CTranslate2 float32 on cpu: greedy "), done.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    "variant", [v for v in VARIANTS if v not in ("post_ln", "layer_norm_epsilon")]
)
def test_trained_run_of_each_variant_exports_exactly(variant, tmp_path):
  """As the post-LN run above, for every other variant: half a minute of training each.
  Beam 4 of the two engines differs by length penalty and beam bookkeeping only, a few BLEU
  points at most on models this weak."""
  fields = {**TRAINED, **VARIANTS[variant]}
  if "key_dim" in fields:
    fields.update(key_dim=8, value_dim=8)  # d_model/h = 16
  if "num_decoder_layers" in fields:
    # 2 encoder layers, 1 decoder layer: deeper decoders learn too slowly for 100 steps.
    fields.update(num_layers=2, num_decoder_layers=1)
  workdir = tmp_path / "run"
  config = train_run(workdir, 100, **fields)
  ctranslate2_model.export_run(str(workdir), str(tmp_path / "ct2"))
  result = check_exported_run(workdir, tmp_path / "ct2", config, beam_bleu_gap=3.0)
  print(variant, result)
  assert result["beam4_bleu"][0] > 1.0, result  # it learned something: the comparison means it
