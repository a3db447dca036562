"""LightningDataModules (``regression.py``, ``char.py``), where a text comes from (``sources.py``) and the
resumable train sampler (``samplers.py``). Nothing here imports a task or the training machinery."""
