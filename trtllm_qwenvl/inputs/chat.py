"""OpenAI-style chat messages -> a templated prompt with one placeholder per media item, plus the media."""
from .media import load_image, load_video

MEDIA_PARTS = {"image": "image", "image_url": "image", "video": "video", "video_url": "video"}


def part_source(part: dict):
    kind = part["type"]
    value = part.get(kind)
    return value["url"] if isinstance(value, dict) and "url" in value else value


def split_content(content) -> tuple[list[dict], dict[str, list]]:
    """Template-ready parts ({"type": "text"|"image"|"video"}) and the loaded media by modality."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}], {}
    parts, media = [], {}
    for part in content:
        kind = part.get("type")
        if kind == "text":
            parts.append({"type": "text", "text": part["text"]})
        elif kind in MEDIA_PARTS:
            modality = MEDIA_PARTS[kind]
            loader = load_image if modality == "image" else load_video
            media.setdefault(modality, []).append(loader(part_source(part)))
            parts.append({"type": modality})
        else:
            raise ValueError(f"unsupported content part type {kind!r}")
    return parts, media


def build_chat_prompt(tokenizer, messages: list[dict], chat_template: str | None = None) -> dict:
    templated, media = [], {}
    for message in messages:
        parts, loaded = split_content(message.get("content", ""))
        for modality, items in loaded.items():
            media.setdefault(modality, []).extend(items)
        templated.append({"role": message["role"], "content": parts})
    prompt = tokenizer.apply_chat_template(templated, tokenize=False, add_generation_prompt=True,
                                           chat_template=chat_template)
    return {"prompt": prompt, "multi_modal_data": media} if media else {"prompt": prompt}
