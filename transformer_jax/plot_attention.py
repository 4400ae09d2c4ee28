"""Attention figures, as in the paper's Figures 3-5: what every head of a layer attends to.

  python -m transformer_jax.plot_attention --workdir DIR --sentence "A man is riding a bike."
      [--layer -1] [--checkpoint auto] [--beam_size 4] [--output attention.png]

The sentence is translated with the run's decoding settings; then one teacher-forced forward
pass over (source, translation) records the attention weights of every layer (einsum path,
`MultiHeadAttention` sows them into the "intermediates" collection when it is mutable). The
figure has one row per attention kind of the chosen layer (encoder self-attention, decoder
self-attention, encoder-decoder attention) and one column per head, with the subword tokens on
the axes: rows are queries, columns keys. Decoder rows are labelled with the token each position
outputs. Prints one JSON line: the output file, the translation and the checkpoint used.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
from absl import app, flags

from transformer_jax import cli, errors, figures
from transformer_jax.data.tokenizer import BOS_ID, EOS_ID
from transformer_jax.model.config import TransformerConfig
from transformer_jax.model.transformer import Transformer

KINDS = (  # (module path inside a layer, figure row title)
    ("encoder", "self_attention", "encoder self-attention"),
    ("decoder", "self_attention", "decoder self-attention (masked)"),
    ("decoder", "cross_attention", "encoder-decoder attention"),
)


def _define_flags():
  flags.DEFINE_string("workdir", None, "The training run's --workdir.")
  flags.DEFINE_string("sentence", None, "The source sentence to translate and show.")
  flags.DEFINE_integer("layer", -1, "Which layer (0-based; negative counts from the top).")
  flags.DEFINE_string("checkpoint", "auto", "Which parameters (see inference.load_run).")
  flags.DEFINE_integer("beam_size", None, "Beam size (default: the run's).")
  flags.DEFINE_string("output", "", "PNG to write; default: WORKDIR/attention.png.")


def attention_weights(model, params, source_ids, target_ids) -> dict[str, np.ndarray]:
  """Every layer's attention weights for one sentence pair, teacher-forced, by the run's `model`
  (a Transformer, a variant of it, or its TransformerConfig).

  source_ids: the source with its EOS; target_ids: the output with its EOS. Returns
  "encoder/layer_0/self_attention"-style keys -> [heads, queries, keys] float32 arrays: encoder
  [h, s, s], decoder self [h, t, t] (over BOS + the output), cross [h, t, s]. A model whose
  layers record none (`sow` "attention_weights") is refused in one line.
  """
  if isinstance(model, TransformerConfig):
    model = Transformer(model)
  model = model.clone(config=model.config.replace(deterministic=True, decode=False))
  inputs = np.asarray([source_ids], np.int32)  # [1, s]
  decoder_inputs = np.asarray([[BOS_ID, *target_ids[:-1]]], np.int32)  # [1, t], shifted right
  _, state = jax.jit(lambda p, x, y: model.apply({"params": p}, x, y, mutable=["intermediates"]))(
      params, inputs, decoder_inputs
  )
  maps = {}
  for path, value in jax.tree_util.tree_leaves_with_path(state.get("intermediates", {})):
    names = [getattr(k, "key", None) for k in path]
    if "attention_weights" in names:
      keep = [n for n in names if isinstance(n, str) and n != "attention_weights"]
      maps["/".join(keep)] = np.asarray(value[0], np.float32)  # sow keeps a tuple; batch 0
  needed = [f"{stack}/layer_0/{name}" for stack, name, _ in KINDS]
  if not all(key in maps for key in needed):
    raise errors.UserError(
        f"the run's model ({type(model).__name__}) records no attention weights where the "
        f"Transformer's layers do ({', '.join(needed)}): plot_attention cannot draw it"
    )
  return maps


def token_labels(tokenizer, ids) -> list[str]:
  special = {EOS_ID: "</s>", BOS_ID: "<s>"}
  return [special.get(i) or tokenizer.decode([i]) or f"#{i}" for i in ids]


def draw(maps: dict[str, np.ndarray], layer: int, labels: dict[str, list[str]], output: str):
  """One row per attention kind of `layer`, one column per head; writes `output` (PNG)."""
  plt = figures.pyplot()
  rows = [
      (title, maps[f"{stack}/layer_{layer}/{name}"], stack, name) for stack, name, title in KINDS
  ]
  heads = rows[0][1].shape[0]
  figure, axes = plt.subplots(
      len(rows),
      heads,
      figsize=(2.2 * heads + 1, 2.4 * len(rows) + 1),
      squeeze=False,
      constrained_layout=True,
  )
  for r, (title, weights, stack, name) in enumerate(rows):
    query_labels = labels["source"] if stack == "encoder" else labels["output"]
    key_labels = {
        "encoder": labels["source"],
        "self_attention": labels["decoder_input"],
        "cross_attention": labels["source"],
    }[stack if stack == "encoder" else name]
    for h in range(heads):
      axis = axes[r][h]
      axis.imshow(weights[h], cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
      axis.set_title(f"{title}, head {h + 1}" if h == 0 else f"head {h + 1}", fontsize=8)
      axis.set_xticks(range(len(key_labels)), key_labels, rotation=90, fontsize=6)
      axis.set_yticks(range(len(query_labels)), query_labels if h == 0 else [], fontsize=6)
  figure.suptitle(f"layer {layer + 1}: rows are queries, columns keys")
  figure.savefig(output, dpi=100)
  plt.close(figure)


def figure_for_sentence(
    workdir: str,
    sentence: str,
    layer: int = -1,
    which: str = "auto",
    beam_size=None,
    output: str = "",
) -> dict:
  """Translates `sentence` with the run in `workdir` and draws one layer's attention."""
  from transformer_jax.runs import inference  # heavy; keeps --help fast

  if not sentence.strip():
    raise errors.UserError("--sentence is empty: give the source sentence to translate")
  output = output or os.path.join(workdir, "attention.png")
  if os.path.isdir(workdir):  # else load_run names the workdir's problem
    figures.check_output(output)  # before the run is loaded and the sentence translated
  run = inference.load_run(workdir, which, beam_size=beam_size)
  layers = run.model_config.num_layers
  if not (run.model_config.decoder_layers == layers and -layers <= layer < layers):
    raise errors.UserError(
        f"--layer={layer}: the model has {layers} layers (0..{layers - 1}, or -1)"
    )
  layer %= layers
  translation = run.decode_lines([sentence])[0]
  limit = run.config.data.max_len - 1
  source_ids = run.tokenizer.encode(sentence.strip())[:limit] + [EOS_ID]
  output_ids = run.tokenizer.encode(translation)[:limit] + [EOS_ID]
  maps = attention_weights(run.model, run.params, source_ids, output_ids)
  labels = {
      "source": token_labels(run.tokenizer, source_ids),
      "output": token_labels(run.tokenizer, output_ids),
      "decoder_input": token_labels(run.tokenizer, [BOS_ID, *output_ids[:-1]]),
  }
  draw(maps, layer, labels, output)
  return {
      "output": output,
      "translation": translation,
      "checkpoint": run.checkpoint,
      "layer": layer,
  }


def main(argv):
  args = cli.workdir_args(argv)
  if not args.sentence:
    raise app.UsageError("--sentence is required")
  try:
    result = figure_for_sentence(
        args.workdir, args.sentence, args.layer, args.checkpoint, args.beam_size, args.output
    )
  except ImportError as e:  # matplotlib missing: figures.pyplot says what to install
    raise errors.UserError(str(e)) from None
  print(json.dumps(result, ensure_ascii=False))


if __name__ == "__main__":
  _define_flags()
  cli.run(main)
