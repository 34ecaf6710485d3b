"""Config-only model directories at the published shapes, for benchmarks with `load_format="dummy"`.

Each directory holds what a published checkpoint holds except the weights: config.json (bfloat16), generation
config, tokenizer files, image/video processor configs with the published resolution bounds, and a VL chat
template. Nothing is downloaded: the config values are those of the Hugging Face hub configs, spelled out here.

    python perf/model_shapes.py qwen3_vl_8b /tmp/qwen3_vl_8b
    python perf/model_shapes.py --check      # AutoConfig/AutoProcessor load, and meta-device parameter counts
"""
import argparse
import contextlib
import pathlib
import sys
import tempfile

import transformers
from torch import nn

from trtllm_qwenvl.models import tiny

QWEN_TOKEN_IDS = {"image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
                  "vision_end_token_id": 151653}

QWEN3_VL_8B = {
    "arch": "qwen3_vl",
    "config_class": transformers.Qwen3VLConfig,
    "architectures": ["Qwen3VLForConditionalGeneration"],
    "token_ids": QWEN_TOKEN_IDS,
    "eos": (tiny.IM_END_ID, tiny.ENDOFTEXT_ID),
    "text": {
        "vocab_size": 151936, "hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 12288, "hidden_act": "silu",
        "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "attention_bias": False,
        "bos_token_id": tiny.ENDOFTEXT_ID, "eos_token_id": tiny.IM_END_ID,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [24, 20, 20],
                            "mrope_interleaved": True},
    },
    "vision": {
        "depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "hidden_act": "gelu_pytorch_tanh",
        "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 4096,
        "num_position_embeddings": 2304, "deepstack_visual_indexes": [8, 16, 24],
    },
    "tie": False,
    # preprocessor_config.json / video_preprocessor_config.json as published (pixels; video: the whole clip).
    "image_size": {"shortest_edge": 65536, "longest_edge": 16777216},
    "video_size": {"shortest_edge": 4096, "longest_edge": 25165824},
    "published_params": 8.77e9,
}

QWEN2_5_VL_7B = {
    "arch": "qwen2_5_vl",
    "config_class": transformers.Qwen2_5_VLConfig,
    "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "token_ids": QWEN_TOKEN_IDS,
    "eos": (tiny.IM_END_ID, tiny.ENDOFTEXT_ID),
    "text": {
        "vocab_size": 152064, "hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28,
        "num_key_value_heads": 4, "intermediate_size": 18944, "hidden_act": "silu",
        "max_position_embeddings": 128000, "rms_norm_eps": 1e-6, "sliding_window": 32768,
        "use_sliding_window": False, "max_window_layers": 28,
        "bos_token_id": tiny.ENDOFTEXT_ID, "eos_token_id": tiny.IM_END_ID,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
    },
    "vision": {
        "depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "hidden_act": "silu",
        "patch_size": 14, "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 3584,
        "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2,
    },
    "tie": False,
    # min_pixels 3136 / max_pixels 12845056 as published; video: qwen-vl-utils' per-frame bounds (HF's defaults).
    "image_size": {"shortest_edge": 3136, "longest_edge": 12845056},
    "video_size": {"shortest_edge": 128 * 28 * 28, "longest_edge": 768 * 28 * 28},
    "published_params": 8.29e9,
}

# transformers.Qwen3_5Config's defaults are the 9B text shape, but its vision out_hidden_size (3584) is not the
# 9B's 4096, so every value is spelled out.
QWEN3_5_9B = {
    "arch": "qwen3_5",
    "config_class": transformers.Qwen3_5Config,
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "token_ids": {},  # Qwen3_5Config's defaults are the Qwen3.5 special-token ids
    "eos": (tiny.QWEN3_5_IM_END_ID, tiny.QWEN3_5_ENDOFTEXT_ID),
    "text": {
        "vocab_size": 248320, "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 16,
        "num_key_value_heads": 4, "head_dim": 256, "intermediate_size": 12288, "hidden_act": "silu",
        "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "attention_bias": False,
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(32)],
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "eos_token_id": tiny.QWEN3_5_ENDOFTEXT_ID,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                            "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    },
    "vision": {
        "depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "hidden_act": "gelu_pytorch_tanh",
        "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 4096,
        "num_position_embeddings": 2304,
    },
    "tie": False,
    "image_size": {"shortest_edge": 65536, "longest_edge": 16777216},
    "video_size": {"shortest_edge": 4096, "longest_edge": 25165824},
    # The hub's 9.65B includes the multi-token-prediction head (about 0.24B), which we do not build: expect 9.41B.
    "published_params": 9.65e9,
}

SHAPES = {"qwen3_vl_8b": QWEN3_VL_8B, "qwen2_5_vl_7b": QWEN2_5_VL_7B, "qwen3_5_9b": QWEN3_5_9B}


def build_config(name: str) -> transformers.PretrainedConfig:
    shape = SHAPES[name]
    tie = shape["tie"]
    return shape["config_class"](
        text_config={**shape["text"], "tie_word_embeddings": tie, "dtype": "bfloat16"},
        vision_config=shape["vision"], tie_word_embeddings=tie, dtype="bfloat16",
        architectures=shape["architectures"], **shape["token_ids"])


def generation_config(name: str) -> transformers.GenerationConfig:
    im_end, endoftext = SHAPES[name]["eos"]
    return transformers.GenerationConfig(bos_token_id=endoftext, eos_token_id=[im_end, endoftext],
                                         pad_token_id=endoftext, do_sample=False)


def make_shape_dir(name: str, out_dir) -> pathlib.Path:
    """Write the config-only directory of model `name` (a key of SHAPES) into `out_dir` and return it."""
    if name not in SHAPES:
        raise ValueError(f"unknown model {name!r}; known: {sorted(SHAPES)}")
    shape = SHAPES[name]
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    build_config(name).save_pretrained(out_dir)
    generation_config(name).save_pretrained(out_dir)
    tiny.build_processor(shape["arch"], shape["image_size"], shape["video_size"]).save_pretrained(out_dir)
    # After the processor save, so the tokenizer files are the shipped ones rather than HF re-exports.
    tiny.copy_tokenizer(shape["arch"], out_dir)
    return out_dir


@contextlib.contextmanager
def params_on_meta():
    """Parameters go to the meta device as they are registered; buffers (rotary tables) are built for real, since
    some constructors run ops the meta device lacks (repeat_interleave without output_size)."""
    register = nn.Module.register_parameter

    def to_meta(module, name, param):
        if param is not None:
            param = nn.Parameter(param.to("meta"), param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = to_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def count_params(model_dir) -> tuple[int, int]:
    """(total, vision) parameters of our model class, built with meta parameters from the directory's config."""
    from trtllm_qwenvl.models.registry import resolve
    config = transformers.AutoConfig.from_pretrained(model_dir)
    with params_on_meta():
        model = resolve(config)(config)
    total = sum(p.numel() for p in model.parameters())
    vision = sum(p.numel() for p in model.visual.parameters()) if model.visual is not None else 0
    return total, vision


def check(name: str, root: pathlib.Path) -> str:
    model_dir = make_shape_dir(name, root / name)
    config = transformers.AutoConfig.from_pretrained(model_dir)
    processor = transformers.AutoProcessor.from_pretrained(model_dir)
    total, vision = count_params(model_dir)
    published = SHAPES[name]["published_params"]
    return (f"| {name} | {config.architectures[0]} | {type(processor).__name__} | {total / 1e9:.3f} | "
            f"{vision / 1e9:.3f} | {published / 1e9:.2f} |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", nargs="?", choices=sorted(SHAPES))
    parser.add_argument("out_dir", nargs="?", type=pathlib.Path)
    parser.add_argument("--check", action="store_true", help="build every shape in a temp dir and print a table")
    args = parser.parse_args(argv)
    if args.check:
        print("| model | architecture | processor | params (B) | vision (B) | published (B) |")
        print("|---|---|---|---|---|---|")
        with tempfile.TemporaryDirectory() as tmp:
            for name in SHAPES:
                print(check(name, pathlib.Path(tmp)))
        return
    if args.name is None or args.out_dir is None:
        parser.error("NAME and OUT_DIR are required unless --check")
    print(make_shape_dir(args.name, args.out_dir))


if __name__ == "__main__":
    sys.exit(main())
