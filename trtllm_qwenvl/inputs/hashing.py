"""Content hashes of media items: the identity the prefix and encoder caches key on."""
import numpy as np
import torch
import xxhash


def hash_media(modality: str, pixel_values: torch.Tensor, grid_thw: tuple[int, int, int], extra: float = 0.0,
               uuid: str | None = None) -> int:
    """Hash of the processed pixels, grid and timing; equal items hash equal whatever their source.

    With a client-given `uuid` the pixels are not read: the client vouches that equal ids mean equal content. The
    grid and timing stay in the key so an id reused at another resolution cannot return the wrong number of rows.
    """
    h = xxhash.xxh3_128()
    h.update(f"{modality}:{grid_thw}:{extra!r}".encode())
    if uuid is not None:
        h.update(b"uuid:" + uuid.encode())
    else:
        h.update(np.ascontiguousarray(pixel_values.numpy()).view(np.uint8))
    return h.intdigest()
