"""Plain PyTorch architectures (no Lightning): usable in a notebook or a plain training loop."""
