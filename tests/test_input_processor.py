"""InputProcessor's pixels against the HF processor's own: in the tower's dtype they are HF's fp32 pixels rounded
once, split per item in prompt order."""
import pytest
import torch
import transformers

from trtllm_qwenvl.inputs.processor import InputProcessor

from conftest import hf_inputs, scenarios


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scenario", ["two_images", "image_video"])
def test_pixels_are_hf_pixels_in_the_tower_dtype(checkpoints, media, scenario, dtype):
    model_dir = checkpoints("qwen3_vl")
    hf = transformers.AutoProcessor.from_pretrained(model_dir)
    prompt = scenarios(hf, media)[scenario]
    ref = hf_inputs(hf, prompt)
    ours = InputProcessor(str(model_dir), transformers.AutoConfig.from_pretrained(model_dir), pixel_dtype=dtype)
    items = ours(prompt).mm_items
    for modality, key in (("image", "pixel_values"), ("video", "pixel_values_videos")):
        got = [item.pixel_values for item in items if item.modality == modality]
        if key not in ref:
            assert not got
            continue
        assert all(p.dtype == dtype for p in got)
        assert torch.equal(torch.cat(got), ref[key].to(dtype))
