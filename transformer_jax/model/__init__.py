"""The Transformer of §3: its config, attention, layers, the model, and its incremental form."""
