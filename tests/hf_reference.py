"""HF transformers as the reference: the checkpoint's own processor and model on the same prompt. Shared by the CPU
suite (conftest.py) and the GPU suites (integration/gpu/engine_refs.py)."""
import torch
import transformers


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

    def __init__(self, model_dir, max_new_tokens: int = 32):
        self.max_new_tokens = max_new_tokens
        self.processor = transformers.AutoProcessor.from_pretrained(model_dir)
        self.model = transformers.AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.model.generation_config.eos_token_id = None
        self.cache = {}

    def logits(self, prompt: dict) -> torch.Tensor:
        with torch.no_grad():
            return self.model(**hf_inputs(self.processor, prompt)).logits[0, -1]

    def greedy(self, prompt: dict, max_new_tokens: int | None = None) -> list[int]:
        max_new_tokens = max_new_tokens or self.max_new_tokens
        key = (repr(prompt), max_new_tokens)
        if key not in self.cache:
            inputs = hf_inputs(self.processor, prompt)
            with torch.no_grad():
                out = self.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
            self.cache[key] = out[0, inputs["input_ids"].shape[1]:].tolist()
        return self.cache[key]
