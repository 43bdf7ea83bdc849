"""Small helpers: devices, memory counts, per-replica weights, an epoch loop."""
