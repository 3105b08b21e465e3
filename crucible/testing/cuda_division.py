"""Division by a Python number the way PyTorch's CUDA kernel does it, on the CPU.

When the divisor of a true division is a CPU scalar (a Python number), the
CUDA kernel computes ``a * fp32(1/b)`` instead of the correctly rounded
``a / b`` the CPU computes, which can be one ulp off. Code whose results must
be bitwise the same on every device divides by a tensor on the dividend's
device instead. Under ``CudaScalarDivision()`` the CPU computes such
divisions the CUDA way, so a CPU test can tell whether any division by a
Python number is left in a path that must agree across devices.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

_DIVISIONS = {torch.Tensor.__truediv__, torch.Tensor.div, torch.Tensor.div_, torch.div, torch.true_divide}


class CudaScalarDivision(TorchFunctionMode):
    """Tensor / Python number computed as ``a * fp32(1/b)`` (float32 tensors);
    ``count`` says how many such divisions ran."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func in _DIVISIONS and len(args) == 2 and not kwargs and isinstance(args[1], (int, float))
                and not isinstance(args[1], bool) and isinstance(args[0], torch.Tensor)
                and args[0].dtype == torch.float32):
            a, b = args
            self.count += 1
            inv = torch.tensor(np.float32(1) / np.float32(b), dtype=torch.float32)
            return a.mul_(inv) if func is torch.Tensor.div_ else a * inv
        return func(*args, **kwargs)
