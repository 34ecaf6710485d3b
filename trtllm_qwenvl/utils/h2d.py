"""The one way host data reaches the device: pinned staging plus a non-blocking copy."""
import numpy as np
import torch


def async_tensor_h2d(data, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Copy host data (list, ndarray or CPU tensor) to `device` without blocking the host.

    On CPU the tensor is returned as is: there is nothing to overlap.
    """
    if isinstance(data, np.ndarray):
        cpu = torch.from_numpy(data).to(dtype)
    else:
        cpu = torch.as_tensor(data, dtype=dtype)
    device = torch.device(device)
    if device.type == "cpu":
        return cpu
    if not cpu.is_pinned():
        cpu = cpu.pin_memory()
    return cpu.to(device, non_blocking=True)
