"""OpenAI-style chat messages -> a templated prompt with one placeholder per media item, plus the media.

A media part may carry `"uuid"`: the client's content id for that item (as vLLM's `multi_modal_uuids`). The
engine then keys its encoder and prefix caches on the id instead of hashing the pixels.
"""
from .media_loader import MediaLoader

MEDIA_PARTS = {"image": "image", "image_url": "image", "video": "video", "video_url": "video"}


def part_source(part: dict):
    kind = part["type"]
    value = part.get(kind)
    return value["url"] if isinstance(value, dict) and "url" in value else value


def as_parts(content) -> list[dict]:
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    for part in content:
        if part.get("type") != "text" and part.get("type") not in MEDIA_PARTS:
            raise ValueError(f"unsupported content part type {part.get('type')!r}")
    return list(content)


def count_media(messages: list[dict]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for message in messages:
        for part in as_parts(message.get("content")):
            if part["type"] in MEDIA_PARTS:
                modality = MEDIA_PARTS[part["type"]]
                counts[modality] = counts.get(modality, 0) + 1
    return counts


def build_chat_prompt(tokenizer, messages: list[dict], loader: MediaLoader, chat_template: str | None = None) -> dict:
    """Checks the media counts before loading anything, then loads each item in message order."""
    loader.check_counts(count_media(messages))
    templated, media, uuids = [], {}, {}
    for message in messages:
        parts = []
        for part in as_parts(message.get("content")):
            if part["type"] == "text":
                parts.append({"type": "text", "text": part["text"]})
                continue
            modality = MEDIA_PARTS[part["type"]]
            media.setdefault(modality, []).append(loader.load(modality, part_source(part)))
            uuids.setdefault(modality, []).append(part.get("uuid"))
            parts.append({"type": modality})
        templated.append({"role": message["role"], "content": parts})
    prompt = {"prompt": tokenizer.apply_chat_template(templated, tokenize=False, add_generation_prompt=True,
                                                      chat_template=chat_template)}
    if media:
        prompt["multi_modal_data"] = media
    if any(u is not None for items in uuids.values() for u in items):
        prompt["multi_modal_uuids"] = uuids
    return prompt
