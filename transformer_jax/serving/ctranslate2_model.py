"""A trained run as a CTranslate2 model (CTranslate2: a C++ engine for Transformer translation).

The command is `python -m transformer_jax.export` (export.py). Its output is a CTranslate2 model
directory: `model.bin` (the weights, quantized as asked), `shared_vocabulary.json` (one token per
id, the run's vocabulary), `config.json` (special tokens, LayerNorm ε) and, for a SentencePiece run,
`sentencepiece.model` to cut text into its pieces. Translate with it (`pip install -e '.[export]'`):

  import ctranslate2, sentencepiece
  sp = sentencepiece.SentencePieceProcessor(model_file="OUT/sentencepiece.model")
  translator = ctranslate2.Translator("OUT", device="cpu", inter_threads=1, intra_threads=2)
  pieces = [sp.encode(line, out_type=str) for line in ["A man rides a bike."]]
  results = translator.translate_batch(
      pieces, beam_size=4, max_decoding_length=256,  # at most the run's model.max_len
      min_decoding_length=0, suppress_sequences=[["<pad>"], ["<s>"]])  # as the project's search
  print([sp.decode(r.hypotheses[0]) for r in results])

A run on whitespace words (the synthetic task's vocab.txt) takes `line.split()` as its tokens and
gives back words. The source needs no EOS (the config adds it, as the project's batches do) and
the target starts from `<s>`, the project's BOS. The project's search never emits PAD or BOS and
may end at once (decode.py), hence `suppress_sequences` and `min_decoding_length=0`; greedy
translations are then the project's, token for token. Beam search ranks by a different length
penalty (docs/export.md).

The parameters are restored as `inference.load_run` restores them (parameters only, the same
`--checkpoint` choices as translate) and written into a `ctranslate2.specs.TransformerSpec`, one
small function per kind of layer. What the two models share, and what makes them equal:
  §3.4    embeddings scaled by √d_model (CTranslate2's `scale_embeddings`); the shared matrix is
          both embeddings and the pre-softmax projection (CTranslate2 stores it once, aliased).
  §3.5    the project's own position table is written as the position encodings: CTranslate2's
          built-in sinusoids put all sines before all cosines, ours interleave them (sin on even,
          cos on odd dimensions); learned positions (Table 3 row E) are written the same way.
  §3.2.2  W^Q, W^K, W^V [e, h, d] become [h·d, e] matrices, head-major, fused as CTranslate2
          expects: Q, K and V in one matrix for self-attention, K and V for encoder-decoder
          attention; W^O [h, d, e] becomes [e, h·d]. No biases (the model has none).
  §3.1    post-LN (`pre_norm=False`, no final norm) or pre-LN (`pre_norm=True` with the final
          norm of each stack); LayerNorm ε from the model config.
  ids     PAD 0, EOS 1, BOS 2, UNK 3 (data/tokenizer.py) are `<pad>`, `</s>`, `<s>`, `<unk>`.

Refused, with one line naming the variant: d_k ≠ d_v (Table 3 row B), which CTranslate2 cannot
express (one head size for queries, keys and values). d_k = d_v ≠ d_model/h is written with
CTranslate2's `head_dim`. Stacked `scan_layers` parameters are unstacked; bfloat16 parameters
are widened to float32 exactly (or kept in bfloat16 with `--quantization bfloat16`). The compute
dtype of the run (`model.dtype`) is not part of the export: CTranslate2 chooses its own
`compute_type` when it loads the model.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any

import numpy as np

from transformer_jax import errors

FORMATS = ("ctranslate2",)
QUANTIZATIONS = ("float32", "int8", "int8_float32", "float16", "bfloat16")
SENTENCEPIECE_FILE = "sentencepiece.model"  # the run's SentencePiece model, in the output
# The project's reserved ids (data/tokenizer.py) and the token strings CTranslate2 looks them up
# by in the model's config.json.
SPECIAL_TOKENS = {"pad": (0, "<pad>"), "eos": (1, "</s>"), "bos": (2, "<s>"), "unk": (3, "<unk>")}


class ExportError(errors.UserError):
  """The run cannot be exported as asked; the message names the variant, flag or path."""


def output_limit(num_source_ids: int, extra: int, max_len: int) -> int:
  """`max_decoding_length` for one sentence that makes CTranslate2 stop where the project's search
  does (search.output_limits): its source ids, EOS and `eval.max_decode_extra`, within the
  position table. CTranslate2 takes one limit per call; decode the sentences of one limit
  together, or decode longer and cut each greedy output at its own limit, which is exact
  (greedy never looks ahead)."""
  return min(num_source_ids + 1 + extra, max_len)


def import_ctranslate2():
  """The ctranslate2 module, or an ExportError saying how to install it."""
  try:
    import ctranslate2  # an optional extra (.[export])
  except ImportError:
    raise ExportError(
        "--format=ctranslate2 needs the ctranslate2 package: pip install -e '.[export]'"
    ) from None
  return ctranslate2


def unsupported_reason(model) -> str | None:
  """Why CTranslate2 cannot express this model exactly (None: it can). `model`: a run's model
  (tasks/base.py `Task.build_model`), or the TransformerConfig of the paper's Transformer."""
  from transformer_jax.model.attention import MultiHeadAttention
  from transformer_jax.model.config import TransformerConfig
  from transformer_jax.model.transformer import Transformer

  if not isinstance(model, TransformerConfig) and (
      type(model) is not Transformer or model.attention is not MultiHeadAttention
  ):
    return (
        f"the run's model is {type(model).__name__} with {getattr(model, 'attention', None)!r} "
        "(its task's own, or a variant), not the paper's Transformer: CTranslate2 computes the "
        "paper's layers only, so this model cannot be exported to it"
    )
  model_config = model if isinstance(model, TransformerConfig) else model.config
  if model_config.relative_positions:
    return (
        f"model.relative_positions={model_config.relative_positions}: the encoder adds a learned "
        "bias per head for each clipped key-query offset, which CTranslate2's Transformer has no "
        "place for, so this model cannot be exported to it"
    )
  if model_config.head_key_dim != model_config.head_value_dim:
    return (
        f"model.key_dim={model_config.head_key_dim} != model.value_dim="
        f"{model_config.head_value_dim} (d_k != d_v, Table 3 row B): CTranslate2 has one head "
        "size for queries, keys and values, so this model cannot be exported to it"
    )
  return None


def vocabulary_tokens(vocab_path: str) -> list[str]:
  """The token of each id, in id order, of a run's vocabulary file (SentencePiece `.model` or a
  WordTokenizer's `.txt`); the reserved ids must hold the tokens CTranslate2 is told about."""
  if vocab_path.endswith(".model"):
    import sentencepiece as spm

    processor = spm.SentencePieceProcessor(model_file=vocab_path)
    tokens = [processor.id_to_piece(i) for i in range(processor.get_piece_size())]
  else:
    with open(vocab_path, encoding="utf-8") as f:
      tokens = f.read().splitlines()
  for name, (index, token) in SPECIAL_TOKENS.items():
    if len(tokens) <= index or tokens[index] != token:
      found = tokens[index] if len(tokens) > index else None
      raise ExportError(
          f"{vocab_path}: id {index} ({name}) is {found!r}, expected {token!r} "
          "(data/tokenizer.py's reserved ids)"
      )
  return tokens


# ----------------------------------------------------------------------------- layers


def _array(x) -> np.ndarray:
  """A parameter as a host float32 array of its own (bfloat16 widens exactly); CTranslate2's
  quantization writes into the arrays it is given."""
  return np.array(x, dtype=np.float32)


def set_linear(spec, kernel: np.ndarray, bias: np.ndarray | None = None) -> None:
  """A [in, out] kernel (Flax) -> CTranslate2's [out, in] weight."""
  spec.weight = np.ascontiguousarray(kernel.T)
  if bias is not None:
    spec.bias = bias


def _heads_in(kernel: np.ndarray) -> np.ndarray:
  """W^Q, W^K or W^V [e, h, d] -> [h·d, e]: row h_i·d + j is head h_i's dimension j."""
  e, h, d = kernel.shape
  return np.ascontiguousarray(kernel.reshape(e, h * d).T)  # [h·d, e]


def set_attention(spec, p: dict, self_attention: bool) -> None:
  """§3.2.2 multi-head attention (no biases). CTranslate2 fuses Q, K, V for self-attention
  (linear_0 [3·h·d, e]) and K, V for encoder-decoder attention (linear_1 [2·h·d, e])."""
  query, key, value = (_heads_in(_array(p[n])) for n in ("query", "key", "value"))
  if self_attention:
    spec.linear[0].weight = np.concatenate([query, key, value])  # [3·h·d, e]
  else:
    spec.linear[0].weight = query  # [h·d, e]
    spec.linear[1].weight = np.concatenate([key, value])  # [2·h·d, e]
  out = _array(p["out"])  # W^O [h, d, e]
  spec.linear[-1].weight = np.ascontiguousarray(out.reshape(-1, out.shape[-1]).T)  # [e, h·d]


def set_layer_norm(spec, p: dict) -> None:
  spec.gamma = _array(p["scale"])
  spec.beta = _array(p["bias"])


def set_ffn(spec, p: dict, norm: dict) -> None:
  """§3.3 Eq. 2, and the LayerNorm of its sub-layer."""
  set_linear(spec.linear_0, _array(p["wi"]["kernel"]), _array(p["wi"]["bias"]))
  set_linear(spec.linear_1, _array(p["wo"]["kernel"]), _array(p["wo"]["bias"]))
  set_layer_norm(spec.layer_norm, norm)


def set_encoder_layer(spec, p: dict) -> None:
  set_attention(spec.self_attention, p["self_attention"], self_attention=True)
  set_layer_norm(spec.self_attention.layer_norm, p["attention_block"]["norm"])
  set_ffn(spec.ffn, p["ffn"], p["ffn_block"]["norm"])


def set_decoder_layer(spec, p: dict) -> None:
  set_attention(spec.self_attention, p["self_attention"], self_attention=True)
  set_layer_norm(spec.self_attention.layer_norm, p["self_attention_block"]["norm"])
  set_attention(spec.attention, p["cross_attention"], self_attention=False)
  set_layer_norm(spec.attention.layer_norm, p["cross_attention_block"]["norm"])
  set_ffn(spec.ffn, p["ffn"], p["ffn_block"]["norm"])


def position_table(model_config, stack: dict) -> np.ndarray:
  """[max_len, e]: §3.5's sinusoids as the model computes them, or the learned table (row E)."""
  if model_config.positional == "learned":
    return _array(stack["positions"]["position_embedding"])
  from transformer_jax.model.transformer import sinusoidal_positions

  return sinusoidal_positions(model_config.max_len, model_config.d_model)


def set_stack(spec, model_config, stack: dict, embedding: np.ndarray, set_layer) -> None:
  """An encoder or decoder: embeddings (scaled by √d_model, §3.4), positions, layers and, for
  pre-LN, the final norm."""
  embeddings = spec.embeddings[0] if isinstance(spec.embeddings, list) else spec.embeddings
  embeddings.weight = embedding
  spec.scale_embeddings = True  # × √d_model, d_model = the embedding width
  spec.position_encodings.encodings = position_table(model_config, stack)
  for i, layer in enumerate(spec.layer):
    set_layer(layer, stack[f"layer_{i}"])
  if model_config.norm_position == "pre":
    set_layer_norm(spec.layer_norm, stack["final_norm"])


def transformer_spec(model_config, params: Any, tokens: list[str]):
  """A filled `ctranslate2.specs.TransformerSpec` of the model (`model_config`, `params`) over
  the vocabulary `tokens` (one per id). Raises ExportError for a model it cannot express."""
  from ctranslate2.specs import transformer_spec as ct2_spec

  from transformer_jax.parallel.layer_params import unstack_layer_params

  reason = unsupported_reason(model_config)
  if reason:
    raise ExportError(reason)
  if len(tokens) != model_config.vocab_size:
    raise ExportError(
        f"the vocabulary has {len(tokens)} tokens, the model's embeddings "
        f"{model_config.vocab_size} rows"
    )
  params = unstack_layer_params(params)  # scan_layers: `layers` [n, ...] -> layer_0, layer_1, ...
  pre_norm = model_config.norm_position == "pre"
  head_dim = model_config.head_key_dim
  common = {
      "num_heads": model_config.num_heads,
      "pre_norm": pre_norm,
      "no_final_norm": not pre_norm,
      # Only when it differs from d_model / h, so a standard model's spec is the usual one.
      "head_dim": None if head_dim * model_config.num_heads == model_config.d_model else head_dim,
  }
  encoder = ct2_spec.TransformerEncoderSpec(model_config.num_layers, **common)
  decoder = ct2_spec.TransformerDecoderSpec(model_config.decoder_layers, **common)
  spec = ct2_spec.TransformerSpec(encoder, decoder)
  if model_config.share_embeddings:
    # §3.4: one matrix for both embeddings and the pre-softmax projection.
    source = target = projection = _array(params["shared_embedding"]["embedding"])  # [v, e]
  else:
    source = _array(params["source_embedding"]["embedding"])  # [v, e]
    target = _array(params["target_embedding"]["embedding"])  # [v, e]
    projection = np.ascontiguousarray(_array(params["output_projection"]["kernel"]).T)  # [v, e]
  set_stack(spec.encoder, model_config, params["encoder"], source, set_encoder_layer)
  set_stack(spec.decoder, model_config, params["decoder"], target, set_decoder_layer)
  spec.decoder.projection.weight = projection  # logits = y · projectionᵀ, no bias
  spec.config.layer_norm_epsilon = model_config.layer_norm_epsilon
  spec.config.unk_token = SPECIAL_TOKENS["unk"][1]
  spec.config.bos_token = SPECIAL_TOKENS["bos"][1]
  spec.config.eos_token = SPECIAL_TOKENS["eos"][1]
  spec.config.decoder_start_token = SPECIAL_TOKENS["bos"][1]  # the first decoder input (BOS)
  spec.config.add_source_eos = True  # sources end with EOS, as in data/batching.py
  spec.register_source_vocabulary(tokens)
  spec.register_target_vocabulary(tokens)
  return spec


def _to_bfloat16(spec) -> None:
  """Float weights as bfloat16 numpy arrays, so CTranslate2 keeps them as they are (its own
  conversion of a numpy array to bfloat16 goes through PyTorch)."""
  import jax.numpy as jnp
  from ctranslate2.specs import model_spec

  def cast(layer, name, value):
    if isinstance(value, np.ndarray) and value.dtype == np.float32:
      setattr(layer, name.split("/")[-1], value.astype(jnp.bfloat16))

  model_spec.visit_spec(spec, cast)


def export_ctranslate2(
    model_config, params: Any, vocab_path: str, output: str, quantization: str = "float32"
) -> str:
  """Writes the model as a CTranslate2 model directory `output` (which must not exist yet; its
  parent must). A SentencePiece vocabulary is copied in as SENTENCEPIECE_FILE. Returns `output`.

  The directory is written beside `output` and renamed into place: a failed export leaves
  nothing behind.
  """
  check_output(output)
  check_quantization(quantization)
  import_ctranslate2()
  spec = transformer_spec(model_config, params, vocabulary_tokens(vocab_path))
  if vocab_path.endswith(".model"):
    spec.register_file(vocab_path, SENTENCEPIECE_FILE)
  if quantization == "bfloat16":
    _to_bfloat16(spec)
  spec.validate()
  spec.optimize(quantization=quantization)  # aliases the shared embedding; quantizes
  parent = os.path.dirname(os.path.abspath(output))
  tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(output)}.", dir=parent)
  try:
    spec.save(tmp)
    os.replace(tmp, output)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return output


def check_output(output: str) -> None:
  if not output:
    raise ExportError("--output is required: the CTranslate2 model directory to write")
  parent = os.path.dirname(os.path.abspath(output))
  if not os.path.isdir(parent):
    raise ExportError(f"--output={output}: its directory {parent} does not exist")
  if os.path.exists(output):
    raise ExportError(f"--output={output} exists; remove it or choose a new directory")


def check_quantization(quantization: str) -> None:
  if quantization not in QUANTIZATIONS:
    raise ExportError(
        f"--quantization={quantization!r}: expected one of {', '.join(QUANTIZATIONS)}"
    )


def export_run(
    workdir: str,
    output: str,
    which: str = "auto",
    quantization: str = "float32",
    export_format: str = "ctranslate2",
) -> dict:
  """Exports the parameters `which` (see `inference.resolve_checkpoint`) of the run in
  `workdir`; returns what was written (also saved as OUT/export.json)."""
  if export_format not in FORMATS:
    raise ExportError(f"--format={export_format!r}: expected one of {', '.join(FORMATS)}")
  check_quantization(quantization)
  check_output(output)
  if not os.path.isdir(workdir):
    raise ExportError(f"--workdir={workdir} is not a directory")
  import_ctranslate2()
  from transformer_jax.runs import inference

  # Checked before any parameter is read: the saved config (then its task's model, which needs
  # the vocabulary) says whether it can.
  config = inference.load_config(workdir)
  reason = unsupported_reason(_model_config(config)) or unsupported_reason(
      _run_model(config, workdir)
  )
  if reason:
    raise ExportError(reason)
  run = inference.load_run(workdir, which)
  vocab_path = workdir_vocabulary(workdir)
  export_ctranslate2(run.model_config, run.params, vocab_path, output, quantization)
  info = {
      "workdir": os.path.abspath(workdir),
      "checkpoint": run.checkpoint,
      "format": export_format,
      "quantization": quantization,
      "tokens": "sentencepiece" if vocab_path.endswith(".model") else "whitespace words",
  }
  with open(os.path.join(output, "export.json"), "w", encoding="utf-8") as f:
    json.dump(info, f, indent=2)
    f.write("\n")
  return info


def workdir_vocabulary(workdir: str) -> str:
  """The path of the vocabulary file a run keeps in its workdir (SentencePiece or words)."""
  from transformer_jax.data import pipeline

  for name in (pipeline.SPM_VOCAB, pipeline.WORD_VOCAB):
    if os.path.exists(os.path.join(workdir, name)):
      return os.path.join(workdir, name)
  raise ExportError(
      f"{workdir} holds no vocabulary ({pipeline.SPM_VOCAB} or {pipeline.WORD_VOCAB}): is it "
      "the --workdir of a training run?"
  )


def _model_config(config):
  from transformer_jax import config as config_lib

  return config_lib.model_config(config, vocab_size=64)  # placeholder vocabulary: shapes only


def _run_model(config, workdir: str):
  """The model of the run in `workdir` (its task's), nothing computed."""
  from transformer_jax import errors, tasks
  from transformer_jax.data import pipeline

  try:
    tokenizer = pipeline.load_workdir_tokenizer(workdir)
  except (FileNotFoundError, ValueError) as e:
    raise errors.UserError(str(e)) from None
  return tasks.get(config.task).build_model(config, tokenizer)
