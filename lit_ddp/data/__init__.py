"""LightningDataModules and everything they read: one module per task, plus the shared pieces.

- :mod:`lit_ddp.data.regression`: the tutorial's synthetic regression data.
- :mod:`lit_ddp.data.char`: characters of a text as next-token windows, and its vocabulary (minGPT).
- :mod:`lit_ddp.data.sources`: where a text comes from: the embedded Tiny Shakespeare, a path, or an fsspec
  URL downloaded once into a sha256-checked cache.
- :mod:`lit_ddp.data.samplers`: the train sampler whose position a checkpoint restores exactly.

Nothing here imports Lightning's training machinery beyond ``LightningDataModule``, nor any task.
"""
