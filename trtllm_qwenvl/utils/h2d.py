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


class StagingBuffers:
    """Named device buffers sized once from the engine limits, each with a pinned host twin.

    `put` writes a step's array into the twin and copies it with one non-blocking H2D into the front of the
    device buffer, so a step allocates nothing and the device addresses never change: CUDA graphs read these
    buffers as their static inputs. Each buffer is flat, so every staged region is one contiguous copy.
    `put_all` stages a whole step and keeps its twins from being rewritten before its copies have read them.
    """

    def __init__(self, sizes: dict[str, tuple[int, torch.dtype]], device: torch.device):
        self.device = device
        self.on_cpu = device.type == "cpu"
        self.device_bufs = {name: torch.zeros(n, dtype=dtype, device=device) for name, (n, dtype) in sizes.items()}
        self.host_bufs = {} if self.on_cpu else {
            name: torch.zeros(n, dtype=dtype, pin_memory=True) for name, (n, dtype) in sizes.items()}
        self.copied = None if self.on_cpu else torch.cuda.Event()

    def put_all(self, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """`put` each array. With the overlap scheduler the host stages a step while the GPU may not yet have run
        the previous step's copies out of the same twins, so this first waits for those copies (by then they are
        next in the stream, so the wait is short)."""
        if self.copied is not None:
            self.copied.synchronize()
        dev = {name: self.put(name, data) for name, data in arrays.items()}
        if self.copied is not None:
            self.copied.record()
        return dev

    def put(self, name: str, data: np.ndarray) -> torch.Tensor:
        """The device view of `data` (same shape) at the front of buffer `name`."""
        dst = self.device_bufs[name][:data.size]
        if self.on_cpu:
            return dst.copy_(torch.from_numpy(data.reshape(-1))).view(data.shape)
        src = self.host_bufs[name][:data.size]
        src.numpy()[:] = data.reshape(-1)
        return dst.copy_(src, non_blocking=True).view(data.shape)
