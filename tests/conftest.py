"""Shared fixtures: tiny checkpoints, bundled media, and HF-transformers references on the same directories."""
import pathlib

import pytest
import torch
from PIL import Image

from trtllm_qwenvl.inputs.media import load_video
from trtllm_qwenvl.models import tiny

from hf_reference import HFReference, chat_prompt, hf_inputs  # noqa: F401 (re-exported to the test modules)

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
