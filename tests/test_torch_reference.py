"""The post-LN model equals torch.nn.Transformer carrying the same weights.

torch.nn.Transformer is an independent implementation of the same architecture (§3.1), so equal
encoder and decoder outputs check the wiring the unit tests cannot see: sub-layer order,
residuals, where each LayerNorm sits, mask semantics and the head split. Shapes match
tests/test_model.py (batch 2, source 7, target 6).
"""

import numpy as np
import pytest
from testing import random_params

from transformer_jax.data.tokenizer import BOS_ID, PAD_ID
from transformer_jax.model.config import TransformerConfig
from transformer_jax.model.transformer import Transformer, sinusoidal_positions

torch = pytest.importorskip("torch")

E, H, F = 32, 4, 64  # d_model, heads, d_ff
CONFIG = TransformerConfig(
    vocab_size=40,
    d_model=E,
    num_heads=H,
    num_layers=2,
    d_ff=F,
    max_len=32,
    dropout_rate=0.0,
    deterministic=True,
)
BATCH, SOURCE_LEN, TARGET_LEN = 2, 7, 6


def tensor(x):
  return torch.tensor(np.asarray(x, np.float32))


def copy_attention(torch_attention, params):
  """Our W^Q, W^K, W^V [e, h, d] and W^O [h, d, e] into torch's packed in_proj / out_proj."""
  w_qkv = [np.asarray(params[n]).reshape(E, E) for n in ("query", "key", "value")]  # [e, h*d]
  # torch computes x @ in_proj_weight.T and splits h*d head-major, like our reshape.
  torch_attention.in_proj_weight.copy_(tensor(np.concatenate(w_qkv, axis=1).T))  # [3e, e]
  torch_attention.out_proj.weight.copy_(tensor(np.asarray(params["out"]).reshape(E, E).T))
  # §3.2.2 defines the projections as plain matrices: our attention has no biases.
  torch_attention.in_proj_bias.zero_()
  torch_attention.out_proj.bias.zero_()


def copy_dense(torch_linear, params):
  torch_linear.weight.copy_(tensor(np.asarray(params["kernel"]).T))  # torch stores [out, in]
  torch_linear.bias.copy_(tensor(params["bias"]))


def copy_norm(torch_norm, params):
  torch_norm.weight.copy_(tensor(params["scale"]))
  torch_norm.bias.copy_(tensor(params["bias"]))


def torch_transformer(params):
  torch.manual_seed(0)  # torch's own init is overwritten below; the seed only fixes leftovers
  model = torch.nn.Transformer(
      E,
      H,
      num_encoder_layers=2,
      num_decoder_layers=2,
      dim_feedforward=F,
      dropout=0.0,
      batch_first=True,
      layer_norm_eps=CONFIG.layer_norm_epsilon,
  )
  # torch.nn.Transformer always ends both stacks with an extra LayerNorm. The paper's post-LN
  # model (§3.1) has none: every layer already ends with LayerNorm(x + Sublayer(x)).
  model.encoder.norm = torch.nn.Identity()
  model.decoder.norm = torch.nn.Identity()
  with torch.no_grad():
    for i, layer in enumerate(model.encoder.layers):
      ours = params["encoder"][f"layer_{i}"]
      copy_attention(layer.self_attn, ours["self_attention"])
      copy_norm(layer.norm1, ours["attention_block"]["norm"])  # after self-attention
      copy_dense(layer.linear1, ours["ffn"]["wi"])
      copy_dense(layer.linear2, ours["ffn"]["wo"])
      copy_norm(layer.norm2, ours["ffn_block"]["norm"])  # after the FFN
    for i, layer in enumerate(model.decoder.layers):
      ours = params["decoder"][f"layer_{i}"]
      copy_attention(layer.self_attn, ours["self_attention"])
      copy_attention(layer.multihead_attn, ours["cross_attention"])
      copy_norm(layer.norm1, ours["self_attention_block"]["norm"])  # self-attn -> norm1
      copy_norm(layer.norm2, ours["cross_attention_block"]["norm"])  # cross-attn -> norm2
      copy_dense(layer.linear1, ours["ffn"]["wi"])
      copy_dense(layer.linear2, ours["ffn"]["wo"])
      copy_norm(layer.norm3, ours["ffn_block"]["norm"])  # FFN -> norm3
  return model.eval()


def embed(params, tokens):
  """§3.4-3.5 by hand: embedding · √d_model + PE, the input both stacks of torch receive."""
  embedding = np.asarray(params["shared_embedding"]["embedding"])
  positions = sinusoidal_positions(CONFIG.max_len, E)[: tokens.shape[1]]  # [L, e]
  return tensor(embedding[tokens] * np.sqrt(E) + positions)  # [b, L, e]


def test_matches_torch_transformer():
  params = random_params(CONFIG)
  rng = np.random.default_rng(0)
  inputs = rng.integers(3, 40, size=(BATCH, SOURCE_LEN)).astype(np.int32)
  inputs[1, 4:] = PAD_ID
  decoder_inputs = rng.integers(3, 40, size=(BATCH, TARGET_LEN)).astype(np.int32)
  decoder_inputs[:, 0] = BOS_ID
  decoder_inputs[1, 4:] = PAD_ID

  model = Transformer(CONFIG)
  encoded = model.apply({"params": params}, inputs, method=Transformer.encode)  # [b, s, e]

  def decoder_output(module, encoded, inputs, decoder_inputs):
    return module.decoder(encoded, inputs, decoder_inputs)  # [b, t, e], before the projection

  decoded = model.apply({"params": params}, encoded, inputs, decoder_inputs, method=decoder_output)
  logits = model.apply({"params": params}, inputs, decoder_inputs)  # [b, t, v]

  reference = torch_transformer(params)
  source_pad = torch.tensor(inputs == PAD_ID)  # torch: True = ignore this key
  target_pad = torch.tensor(decoder_inputs == PAD_ID)
  causal = torch.triu(torch.ones(TARGET_LEN, TARGET_LEN, dtype=torch.bool), diagonal=1)
  # Outside torch.no_grad on purpose: with gradients on, torch skips its inference fast path
  # (fused kernels, nested tensors that zero the padded positions) and runs the plain layers.
  memory = reference.encoder(embed(params, inputs), src_key_padding_mask=source_pad)
  output = reference.decoder(
      embed(params, decoder_inputs),
      memory,
      tgt_mask=causal,
      tgt_key_padding_mask=target_pad,
      memory_key_padding_mask=source_pad,
  )
  memory, output = memory.detach().numpy(), output.detach().numpy()

  np.testing.assert_allclose(encoded, memory, atol=1e-5)
  np.testing.assert_allclose(decoded, output, atol=1e-5)
  embedding = np.asarray(params["shared_embedding"]["embedding"])
  np.testing.assert_allclose(logits, output @ embedding.T, atol=1e-4)
