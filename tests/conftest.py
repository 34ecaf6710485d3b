"""Shared fixtures: tiny checkpoints, bundled media, and HF-transformers references on the same directories."""
import pathlib

import pytest
import torch
import transformers
from PIL import Image

from trtllm_qwenvl.inputs.media import load_video
from trtllm_qwenvl.models import tiny

MEDIA = pathlib.Path(__file__).resolve().parents[1] / "examples" / "media"
torch.set_num_threads(2)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """arch -> checkpoint dir, built on first use."""
    cache = {}

    def get(arch: str) -> pathlib.Path:
        if arch not in cache:
            cache[arch] = tiny.make_tiny(arch, tmp_path_factory.mktemp(arch), seed=0)
        return cache[arch]
    return get


@pytest.fixture(scope="session")
def media():
    image = Image.open(MEDIA / "sample.png").convert("RGB")
    return {
        "image": image,
        "image_b": image.rotate(90, expand=True).resize((112, 168)),
        "video": load_video(str(MEDIA / "sample.mp4")),
    }


def chat_prompt(processor, parts: list, text: str) -> str:
    content = [{"type": kind} for kind in parts] + [{"type": "text", "text": text}]
    return processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)


def hf_inputs(processor, prompt: dict):
    """The reference preprocessing: the checkpoint's HF processor on the same prompt, frames used as given."""
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
    """HF transformers on the checkpoint dir: last-position logits and greedy tokens (EOS not stopping)."""

    def __init__(self, model_dir):
        self.processor = transformers.AutoProcessor.from_pretrained(model_dir)
        self.model = transformers.AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.model.generation_config.eos_token_id = None
        self.cache = {}

    def logits(self, prompt: dict) -> torch.Tensor:
        with torch.no_grad():
            return self.model(**hf_inputs(self.processor, prompt)).logits[0, -1]

    def greedy(self, prompt: dict, max_new_tokens: int = 32) -> list[int]:
        key = (repr(prompt), max_new_tokens)
        if key not in self.cache:
            inputs = hf_inputs(self.processor, prompt)
            with torch.no_grad():
                out = self.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
            self.cache[key] = out[0, inputs["input_ids"].shape[1]:].tolist()
        return self.cache[key]


@pytest.fixture(scope="session")
def references(checkpoints):
    cache = {}

    def get(arch: str) -> HFReference:
        if arch not in cache:
            cache[arch] = HFReference(checkpoints(arch))
        return cache[arch]
    return get


def scenarios(processor, media) -> dict[str, dict]:
    """The five parity scenarios as LLM prompts (placeholders + multi_modal_data)."""
    video = {"frames": media["video"].frames, "fps": media["video"].fps}
    return {
        "text": {"prompt": chat_prompt(processor, [], "Write a short poem about the sea.")},
        "image": {"prompt": chat_prompt(processor, ["image"], "Describe this image."),
                  "multi_modal_data": {"image": [media["image"]]}},
        "two_images": {"prompt": chat_prompt(processor, ["image", "image"], "Compare the two images."),
                       "multi_modal_data": {"image": [media["image"], media["image_b"]]}},
        "video": {"prompt": chat_prompt(processor, ["video"], "What happens in this video?"),
                  "multi_modal_data": {"video": [video]}},
        "image_video": {"prompt": chat_prompt(processor, ["image", "video"], "Relate the image to the video."),
                        "multi_modal_data": {"image": [media["image"]], "video": [video]}},
    }


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())
