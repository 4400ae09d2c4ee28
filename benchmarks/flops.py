"""Matmul FLOPs of decoding, per decoder row-step and per source token, for the benchmarks that
hold a search's work against the machine's matmul rate (profile_decode.py, beam_work.py).
Attention over the cache and the source is not counted (its FLOPs grow with the positions, and it
is bound by memory, not by the matmul units)."""


def step_flops_per_row(cfg) -> int:
  """Matmul FLOPs of one decoder step for one row: per layer the self-attention's four
  projections, the cross-attention's query and output projections (its keys and values are
  projected once per sentence), the FFN; then the output projection."""
  e, f, v = cfg.d_model, cfg.d_ff, cfg.vocab_size
  k, vd = cfg.num_heads * cfg.head_key_dim, cfg.num_heads * cfg.head_value_dim
  layer = 2 * e * k + e * vd + vd * e + e * k + vd * e + 2 * e * f
  return 2 * (cfg.decoder_layers * layer + e * v)


def source_flops_per_token(cfg) -> int:
  """Matmul FLOPs of one source token: the encoder's projections and FFN in every layer, and the
  cross-attention keys and values every decoder layer projects from it once per sentence."""
  e, f = cfg.d_model, cfg.d_ff
  k, vd = cfg.num_heads * cfg.head_key_dim, cfg.num_heads * cfg.head_value_dim
  encoder = cfg.num_layers * (2 * e * k + e * vd + vd * e + 2 * e * f)
  return 2 * (encoder + cfg.decoder_layers * (e * k + e * vd))
