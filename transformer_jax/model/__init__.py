"""The Transformer of §3: its config, attention and layers; decoding/ steps it."""
