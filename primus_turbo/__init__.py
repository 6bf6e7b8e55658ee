"""primus-turbo: training operators for large language models on NVIDIA Hopper GPUs.

The PyTorch API lives in :mod:`primus_turbo.pytorch` (``import primus_turbo.pytorch as turbo``).
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
