"""``torch.nn.Module`` layers over ``turbo.ops`` (Linear, Float8Linear, GroupedLinear, ...).

The layers arrive with the ops they wrap; this release ships the functional GEMM only.
"""

__all__: list[str] = []
