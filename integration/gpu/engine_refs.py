"""Shared pieces of the GPU engine suites: tiny checkpoints, scenario prompts and the HF transformers reference
(fp32 on the CPU, the same reference the CPU suite uses)."""
import pathlib
import sys

from PIL import Image

from trtllm_qwenvl import SamplingParams
from trtllm_qwenvl.inputs.media import load_video
from trtllm_qwenvl.models import tiny

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.append(str(REPO / "tests"))  # the CPU suite's HF reference, shared rather than copied
from hf_reference import HFReference, chat_prompt, hf_inputs  # noqa: E402,F401 (hf_inputs: for the parity suite)

MEDIA = REPO / "examples" / "media"
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def tiny_checkpoint(arch: str, tmp_path_factory) -> pathlib.Path:
    return tiny.make_tiny(arch, tmp_path_factory.mktemp(arch), seed=0)


def scenario_prompts(processor) -> list[dict]:
    """Text, image, two images, video, image + video: one of each, as LLM prompts."""
    image = Image.open(MEDIA / "sample.png").convert("RGB")
    other = image.rotate(90, expand=True).resize((112, 168))
    clip = load_video(str(MEDIA / "sample.mp4"))
    video = {"frames": clip.frames, "fps": clip.fps}
    return [
        {"prompt": chat_prompt(processor, [], "Write a short poem about the sea.")},
        {"prompt": chat_prompt(processor, ["image"], "Describe this image."), "multi_modal_data": {"image": [image]}},
        {"prompt": chat_prompt(processor, ["image", "image"], "Compare them."),
         "multi_modal_data": {"image": [image, other]}},
        {"prompt": chat_prompt(processor, ["video"], "What happens?"), "multi_modal_data": {"video": [video]}},
        {"prompt": chat_prompt(processor, ["image", "video"], "Relate them."),
         "multi_modal_data": {"image": [image], "video": [video]}},
    ]


def hf_reference(model_dir) -> HFReference:
    return HFReference(model_dir, GREEDY.max_tokens)
