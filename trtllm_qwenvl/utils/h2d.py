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
    """A step's host arrays, packed into one pinned buffer and copied to the device with one non-blocking H2D.

    Each named array has a dtype and a maximum size, fixed once from the engine limits, so a step allocates
    nothing. A step's arrays are laid back to back in the order the sizes were given; an array's offset depends
    only on the sizes of those before it. CUDA graphs read these views as their static inputs, so the order puts
    the per-token arrays first: a decode step padded to a captured batch size, whose every shape that size fixes,
    and a prefill step padded to a captured token count, whose per-token arrays that count fixes, find their
    arrays at the addresses the graph recorded. One copy per step rather than one per array: at decode batch 1
    each copy took about 3 us of the GPU's step, a dozen of them.
    """

    def __init__(self, sizes: dict[str, tuple[int, torch.dtype]], device: torch.device):
        self.sizes = sizes
        total = sum(aligned(n * dtype.itemsize) for n, dtype in sizes.values())
        self.on_cpu = device.type == "cpu"
        self.device_bytes = torch.zeros(total, dtype=torch.uint8, device=device)
        self.host_bytes = self.device_bytes if self.on_cpu else torch.zeros(total, dtype=torch.uint8,
                                                                            pin_memory=True)
        self.copied = None if self.on_cpu else torch.cuda.Event()

    def put_all(self, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """Device views of `arrays` (same shapes, the buffers' dtypes). With the overlap scheduler the host stages
        a step while the GPU may not yet have run the previous step's copy out of the same pinned buffer, so this
        first waits for that copy (by then it is next in the stream, so the wait is short)."""
        unknown = set(arrays) - set(self.sizes)
        if unknown:
            raise KeyError(f"no staging buffer for {sorted(unknown)}")
        if self.copied is not None:
            self.copied.synchronize()
        offset, views = 0, {}
        for name, (limit, dtype) in self.sizes.items():
            data = arrays.get(name)
            if data is None:
                continue
            if data.size > limit:
                raise ValueError(f"{name} has {data.size} entries, more than its staging buffer's {limit}")
            end = offset + data.size * dtype.itemsize
            self.host_bytes[offset:end].view(dtype).numpy()[:] = data.reshape(-1)
            views[name] = self.device_bytes[offset:end].view(dtype).view(data.shape)
            offset = aligned(end)
        if not self.on_cpu and offset:
            self.device_bytes[:offset].copy_(self.host_bytes[:offset], non_blocking=True)
            self.copied.record()
        return views


def aligned(nbytes: int, to: int = 16) -> int:
    """Offsets stay 16-byte aligned, so every dtype's view of them is aligned too."""
    return -(-nbytes // to) * to
