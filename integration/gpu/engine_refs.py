"""Shared pieces of the GPU engine suites: tiny checkpoints, scenario prompts and the HF transformers reference
(fp32 on the CPU, the same reference the CPU suite uses)."""
import pathlib

import torch
import transformers
from PIL import Image

from trtllm_qwenvl import SamplingParams
from trtllm_qwenvl.inputs.media import load_video
from trtllm_qwenvl.models import tiny

MEDIA = pathlib.Path(__file__).resolve().parents[2] / "examples" / "media"
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def tiny_checkpoint(arch: str, tmp_path_factory) -> pathlib.Path:
    return tiny.make_tiny(arch, tmp_path_factory.mktemp(arch), seed=0)


def chat(processor, parts: list[str], text: str) -> str:
    content = [{"type": kind} for kind in parts] + [{"type": "text", "text": text}]
    return processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)


def scenario_prompts(processor) -> list[dict]:
    """Text, image, two images, video, image + video: one of each, as LLM prompts."""
    image = Image.open(MEDIA / "sample.png").convert("RGB")
    other = image.rotate(90, expand=True).resize((112, 168))
    clip = load_video(str(MEDIA / "sample.mp4"))
    video = {"frames": clip.frames, "fps": clip.fps}
    return [
        {"prompt": chat(processor, [], "Write a short poem about the sea.")},
        {"prompt": chat(processor, ["image"], "Describe this image."), "multi_modal_data": {"image": [image]}},
        {"prompt": chat(processor, ["image", "image"], "Compare them."),
         "multi_modal_data": {"image": [image, other]}},
        {"prompt": chat(processor, ["video"], "What happens?"), "multi_modal_data": {"video": [video]}},
        {"prompt": chat(processor, ["image", "video"], "Relate them."),
         "multi_modal_data": {"image": [image], "video": [video]}},
    ]


def hf_inputs(processor, prompt: dict):
    """The reference preprocessing: the checkpoint's HF processor on an LLM prompt, video frames used as given."""
    mm = prompt.get("multi_modal_data", {})
    kwargs = {}
    if mm.get("image"):
        kwargs["images"] = mm["image"]
    if mm.get("video"):
        kwargs["videos"] = [v["frames"] for v in mm["video"]]
        kwargs["video_metadata"] = [{"fps": v["fps"], "total_num_frames": len(v["frames"]),
                                     "frames_indices": list(range(len(v["frames"])))} for v in mm["video"]]
        kwargs["do_sample_frames"] = False
    return processor(text=[prompt["prompt"]], return_tensors="pt", **kwargs)


class HFReference:
    def __init__(self, model_dir):
        self.processor = transformers.AutoProcessor.from_pretrained(model_dir)
        self.model = transformers.AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.model.generation_config.eos_token_id = None
        self.cache = {}

    def inputs(self, prompt: dict):
        return hf_inputs(self.processor, prompt)

    def greedy(self, prompt: dict, max_new_tokens: int = GREEDY.max_tokens) -> list[int]:
        key = (repr(prompt), max_new_tokens)
        if key not in self.cache:
            inputs = self.inputs(prompt)
            with torch.no_grad():
                out = self.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
            self.cache[key] = out[0, inputs["input_ids"].shape[1]:].tolist()
        return self.cache[key]


def hf_reference(model_dir) -> HFReference:
    return HFReference(model_dir)
