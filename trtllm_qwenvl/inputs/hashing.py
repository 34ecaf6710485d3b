"""Content hashes of media items: the identity the prefix and encoder caches key on."""
import numpy as np
import torch
import xxhash


def hash_media(modality: str, pixel_values: torch.Tensor, grid_thw: tuple[int, int, int], extra: float = 0.0) -> int:
    """Hash of the processed pixels, grid and timing; equal items hash equal whatever their source."""
    h = xxhash.xxh3_128()
    h.update(f"{modality}:{grid_thw}:{extra!r}".encode())
    h.update(np.ascontiguousarray(pixel_values.numpy()).view(np.uint8))
    return h.intdigest()
