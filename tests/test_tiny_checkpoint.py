import json
import pathlib

import pytest
import torch
import transformers
from PIL import Image
from transformers.video_utils import load_video

from trtllm_qwenvl.models import tiny

SAMPLE_VIDEO = pathlib.Path(__file__).resolve().parents[1] / "examples" / "media" / "sample.mp4"

TIED = {"qwen2_5_vl": False, "qwen3_vl": True, "qwen3_vl_moe": False, "qwen3_5": False, "qwen3_5_moe": False}
# 224 / 14 = 16 patches a side for Qwen2.5-VL, 224 / 16 = 14 for Qwen3-VL and Qwen3.5; 2x2 patches per token.
IMAGE_TOKENS = {"qwen2_5_vl": 64, "qwen3_vl": 49, "qwen3_vl_moe": 49, "qwen3_5": 49, "qwen3_5_moe": 49}
# 8 frames -> 4 temporal groups; 128 px rounds to 140 (10 patches) for Qwen2.5-VL, stays 128 (8) for Qwen3-VL.
VIDEO_TOKENS = {"qwen2_5_vl": 100, "qwen3_vl": 64, "qwen3_vl_moe": 64, "qwen3_5": 64, "qwen3_5_moe": 64}
# Special-token ids: the Qwen2/Qwen3 tokenizer's, and the 248k Qwen3.5 one's (as in Qwen3_5Config).
IDS = {
    "qwen2": {"image": 151655, "video": 151656, "vision_start": 151652, "vision_end": 151653, "im_start": 151644,
              "im_end": 151645},
    "qwen3_5": {"image": 248056, "video": 248057, "vision_start": 248053, "vision_end": 248054, "im_start": 248045,
                "im_end": 248046},
}


def ids_of(arch):
    return IDS["qwen3_5" if arch in tiny.HYBRID_ARCHS else "qwen2"]


@pytest.fixture(scope="module", params=tiny.ARCHS)
def arch(request):
    return request.param


@pytest.fixture(scope="module")
def checkpoint(arch, checkpoints):
    return checkpoints(arch)


@pytest.fixture(scope="module")
def processor(checkpoint):
    return transformers.AutoProcessor.from_pretrained(checkpoint, local_files_only=True)


def load_model(checkpoint):
    return transformers.AutoModelForImageTextToText.from_pretrained(checkpoint, local_files_only=True)


def user_prompt(processor, media_type):
    messages = [{"role": "user", "content": [{"type": media_type}, {"type": "text", "text": "Describe it."}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    # Both entry points must see the same VL template.
    assert prompt == processor.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return prompt


def test_weights_are_sharded(checkpoint):
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) >= 2
    assert all((checkpoint / shard).is_file() for shard in shards)


def test_no_parameter_is_constant(checkpoint):
    for name, param in load_model(checkpoint).named_parameters():
        assert param.dtype == torch.float32, name
        # Constant tensors (all-ones norms, zero biases) would hide loader bugs such as a skipped tensor.
        assert param.std() > 0, name


def test_saved_weights_match_seeded_build(arch, checkpoint):
    loaded = load_model(checkpoint).state_dict()
    rebuilt = tiny.build_model(arch, seed=0).state_dict()
    assert loaded.keys() == rebuilt.keys()
    assert all(torch.equal(loaded[name], rebuilt[name]) for name in loaded)
    other = tiny.build_model(arch, seed=1).state_dict()
    assert not torch.equal(loaded["lm_head.weight"], other["lm_head.weight"])


def test_tied_embeddings(arch, checkpoint):
    model = load_model(checkpoint)
    tied = torch.equal(model.lm_head.weight, model.model.language_model.embed_tokens.weight)
    assert tied == model.config.tie_word_embeddings == TIED[arch]


def test_tokenizer_ids_match_config(arch, checkpoint, processor):
    config = transformers.AutoConfig.from_pretrained(checkpoint, local_files_only=True)
    tokenizer = processor.tokenizer
    ids = ids_of(arch)
    assert tokenizer.convert_tokens_to_ids("<|image_pad|>") == config.image_token_id == ids["image"]
    assert tokenizer.convert_tokens_to_ids("<|video_pad|>") == config.video_token_id == ids["video"]
    assert tokenizer.convert_tokens_to_ids("<|vision_start|>") == config.vision_start_token_id == ids["vision_start"]
    assert tokenizer.convert_tokens_to_ids("<|vision_end|>") == config.vision_end_token_id == ids["vision_end"]
    assert tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [ids["im_start"], ids["im_end"]]
    generation = transformers.GenerationConfig.from_pretrained(checkpoint, local_files_only=True)
    assert generation.eos_token_id == tokenizer.eos_token_id == ids["im_end"]


def test_image_expands_to_merged_patches(arch, processor):
    prompt = user_prompt(processor, "image")
    assert prompt.count("<|vision_start|><|image_pad|><|vision_end|>") == 1
    image = Image.new("RGB", (224, 224), (200, 80, 30))
    inputs = processor(text=[prompt], images=[image], return_tensors="pt")
    num_pads = int((inputs["input_ids"] == ids_of(arch)["image"]).sum())
    assert num_pads == int(inputs["image_grid_thw"].prod()) // 4 == IMAGE_TOKENS[arch]


def test_sample_video_is_not_resampled(arch, processor):
    frames, metadata = load_video(str(SAMPLE_VIDEO), backend="pyav")
    inputs = processor(
        text=[user_prompt(processor, "video")], videos=[frames], video_metadata=[metadata], return_tensors="pt"
    )
    assert inputs["video_grid_thw"][0, 0] == len(frames) // 2
    num_pads = int((inputs["input_ids"] == ids_of(arch)["video"]).sum())
    assert num_pads == int(inputs["video_grid_thw"].prod()) // 4 == VIDEO_TOKENS[arch]
