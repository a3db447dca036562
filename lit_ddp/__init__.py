"""lit_ddp: PyTorch's DDP tutorial series rebuilt on PyTorch Lightning."""

__version__ = "0.1.0"
