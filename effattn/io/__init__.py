"""Model and data IO: resolving model names, reading checkpoints lazily, writing outputs atomically."""
