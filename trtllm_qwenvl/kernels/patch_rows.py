"""Whole RGB images (B, H, W, C) uint8 on the device -> the HF processor's normalised patch rows, in one launch.

The torch path (`inputs.pixels.DevicePatchify` then `PixelNorm.apply`) is HF's own patchify (a 9-d permute and
a temporal expand, copied) and then the processor's fp32 subtract and divide: five launches, 0.3 ms of host time
for one 512px image on an H100 host. Here one program gathers a tile of patch rows for one channel straight from
the image, normalises them with the same fp32 arithmetic (the divide rounded to nearest, as torch's) and stores
them into each temporal slot. Row order and columns are HF's: merge units row-major over the grid, the patches of a
unit row-major within it; columns (channel, temporal slot, patch row, patch column).
"""
import torch
import triton
import triton.language as tl


@triton.jit
def patch_rows_kernel(img_ptr, mean_ptr, std_ptr, out_ptr, num_rows, rows_per_image, units_w, height, width,
                      C: tl.constexpr, T: tl.constexpr, P: tl.constexpr, MERGE: tl.constexpr,
                      BLOCK_PP: tl.constexpr, BLOCK_R: tl.constexpr):
    c = tl.program_id(1)
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < num_rows
    image, local = r // rows_per_image, r % rows_per_image
    unit, within = local // (MERGE * MERGE), local % (MERGE * MERGE)
    y0 = ((unit // units_w) * MERGE + within // MERGE) * P
    x0 = ((unit % units_w) * MERGE + within % MERGE) * P
    pp = tl.arange(0, BLOCK_PP)
    pp_ok = pp < P * P
    ok = r_ok[:, None] & pp_ok[None, :]
    y = y0[:, None] + (pp // P)[None, :]
    x = x0[:, None] + (pp % P)[None, :]
    src = ((image.to(tl.int64)[:, None] * height + y) * width + x) * C + c
    raw = tl.load(img_ptr + src, mask=ok, other=0).to(tl.float32)
    value = tl.math.div_rn(raw - tl.load(mean_ptr + c), tl.load(std_ptr + c)).to(out_ptr.dtype.element_ty)
    row = out_ptr + r.to(tl.int64)[:, None] * (C * T * P * P) + pp[None, :]
    for t in tl.static_range(T):
        tl.store(row + (c * T + t) * P * P, value, mask=ok)


def patch_rows(images: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, patch: int, merge: int, temporal: int,
               dtype: torch.dtype) -> torch.Tensor:
    """images (B, H, W, C) uint8, contiguous; mean and std (C,) fp32 on the same device, already divided by the
    rescale factor (`PixelNorm`) -> (B * H/patch * W/patch, C * temporal * patch * patch) in `dtype`."""
    assert images.is_contiguous() and images.dtype == torch.uint8
    b, h, w, c = images.shape
    rows_per_image = (h // patch) * (w // patch)
    out = torch.empty(b * rows_per_image, c * temporal * patch * patch, dtype=dtype, device=images.device)
    block_r = 16
    patch_rows_kernel[(triton.cdiv(out.shape[0], block_r), c)](
        images, mean, std, out, out.shape[0], rows_per_image, w // patch // merge, h, w, C=c, T=temporal, P=patch,
        MERGE=merge, BLOCK_PP=triton.next_power_of_2(patch * patch), BLOCK_R=block_r)
    return out
