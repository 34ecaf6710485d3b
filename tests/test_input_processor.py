"""InputProcessor's pixels against the HF processor's own: raw (uint8 for images) on the host, and after the item's
`PixelNorm` (the encoder applies it on the device) HF's fp32 pixels exactly, split per item in prompt order; in the
tower's dtype, HF's pixels rounded once."""
import pytest
import torch
import transformers

from trtllm_qwenvl.engine.encoder_runner import EncoderRunner
from trtllm_qwenvl.inputs.pixels import RAW, PixelNorm
from trtllm_qwenvl.inputs.processor import InputProcessor

from conftest import chat_prompt, hf_inputs, scenarios


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scenario", ["two_images", "image_video"])
def test_normalised_raw_pixels_are_hf_pixels(checkpoints, media, scenario, dtype):
    model_dir = checkpoints("qwen3_vl")
    hf = transformers.AutoProcessor.from_pretrained(model_dir)
    prompt = scenarios(hf, media)[scenario]
    ref = hf_inputs(hf, prompt)
    ours = InputProcessor(str(model_dir), transformers.AutoConfig.from_pretrained(model_dir))
    items = ours(prompt).mm_items
    assert all(item.pixel_values.dtype == torch.uint8 for item in items if item.modality == "image")
    for modality, key in (("image", "pixel_values"), ("video", "pixel_values_videos")):
        got = [item.norm.apply(item.patches(), dtype) for item in items if item.modality == modality]
        if key not in ref:
            assert not got
            continue
        assert all(p.dtype == dtype for p in got)
        assert torch.equal(torch.cat(got), ref[key].to(dtype))


def assert_image_prompt_is_hfs(out, ref) -> None:
    """Ids, grids and (normalised) pixels of an images-only prompt equal the HF processor's."""
    assert out.token_ids == ref["input_ids"][0].tolist()
    assert [item.grid_thw for item in out.mm_items] == [tuple(g) for g in ref["image_grid_thw"].tolist()]
    pixels = [item.norm.apply(item.patches(), torch.float32) for item in out.mm_items]
    assert torch.equal(torch.cat(pixels), ref["pixel_values"])


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl", "qwen3_5"])
@pytest.mark.parametrize("scenario", ["image", "two_images"])
def test_image_prompts_match_the_hf_processor(checkpoints, media, arch, scenario):
    """Images alone skip the HF processor's text step (the prompt is tokenized as written and each placeholder
    repeated to its image's token count): ids, grids and pixels still equal the HF processor's."""
    model_dir = checkpoints(arch)
    hf = transformers.AutoProcessor.from_pretrained(model_dir)
    prompt = scenarios(hf, media)[scenario]
    ref = hf_inputs(hf, prompt)
    ours = InputProcessor(str(model_dir), transformers.AutoConfig.from_pretrained(model_dir))
    out = ours(prompt)
    assert_image_prompt_is_hfs(out, ref)


@pytest.mark.parametrize("arch, sizes, mode, on_device", [
    ("qwen3_vl", [(224, 160)], "RGB", True),
    ("qwen3_vl", [(224, 160), (128, 96)], "RGB", True),
    ("qwen3_vl", [(224, 160), (112, 168)], "RGB", False),  # the second is resized, so HF patchifies both
    ("qwen3_vl", [(224, 160)], "RGBA", False),  # HF converts it first
    ("qwen2_5_vl", [(112, 168), (224, 56)], "RGB", True),
    ("qwen2_5_vl", [(224, 160)], "RGB", False),
])
def test_kept_size_images_are_patchified_where_they_are_encoded(checkpoints, media, arch, sizes, mode, on_device):
    """Images the processor keeps at their size reach the encoder whole, (H, W, 3) uint8, and the patchify it runs
    gives the HF processor's pixels exactly; a prompt with any other image goes through the HF image processor."""
    model_dir = checkpoints(arch)
    hf = transformers.AutoProcessor.from_pretrained(model_dir)
    images = [media["image"].resize(size).convert(mode) for size in sizes]
    prompt = {"prompt": chat_prompt(hf, ["image"] * len(images), "Compare."), "multi_modal_data": {"image": images}}
    ref = hf_inputs(hf, prompt)
    out = InputProcessor(str(model_dir), transformers.AutoConfig.from_pretrained(model_dir))(prompt)
    assert [item.patchify is not None for item in out.mm_items] == [on_device] * len(images)
    if on_device:
        assert [tuple(item.pixel_values.shape) for item in out.mm_items] == [(h, w, 3) for w, h in sizes]
    assert_image_prompt_is_hfs(out, ref)


def test_encoder_uploads_same_size_images_together(checkpoints, media):
    """The encoder patchifies and normalises a run of same-size images as one batch: its rows are still the HF
    processor's pixels, image after image."""
    model_dir = checkpoints("qwen3_vl")
    hf = transformers.AutoProcessor.from_pretrained(model_dir)
    images = [media["image"].resize(size) for size in [(224, 160), (224, 160), (128, 96), (224, 160)]]
    prompt = {"prompt": chat_prompt(hf, ["image"] * len(images), "Compare."), "multi_modal_data": {"image": images}}
    items = InputProcessor(str(model_dir), transformers.AutoConfig.from_pretrained(model_dir))(prompt).mm_items
    assert all(item.patchify is not None for item in items)
    pixels = EncoderRunner(None, torch.device("cpu"), torch.float32, 0).upload(items)
    assert torch.equal(pixels, hf_inputs(hf, prompt)["pixel_values"])


@pytest.mark.parametrize("settings", [
    {"image_mean": 0.5, "image_std": 0.25},  # HF takes a scalar for every channel
    {"do_rescale": False},
    {"do_normalize": False},
    {"do_rescale": False, "do_normalize": False},
])
def test_pixel_norm_follows_the_processor_settings(checkpoints, media, settings):
    model_dir = checkpoints("qwen3_vl")
    hf = transformers.AutoProcessor.from_pretrained(model_dir, **settings).image_processor
    image = scenarios(transformers.AutoProcessor.from_pretrained(model_dir), media)["image"]["multi_modal_data"]
    ref = hf(images=image["image"], return_tensors="pt")["pixel_values"]
    raw = hf(images=image["image"], return_tensors="pt", **RAW)["pixel_values"]
    assert torch.equal(PixelNorm.of(hf).apply(raw, ref.dtype), ref)
