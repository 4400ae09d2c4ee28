"""Devices: the mesh and sharding rules, multi-host set-up, XLA flags."""
