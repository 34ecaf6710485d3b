"""Incremental detokenization with stop strings.

Each step decodes only a short window of recent tokens, so streaming costs O(new tokens). A trailing incomplete
UTF-8 sequence waits for its bytes, and the last len(longest stop) - 1 characters wait until they cannot start a
stop string, so streamed text never has to be taken back.
"""


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], stop: list[str], skip_special_tokens: bool,
                 include_stop: bool):
        # The Rust tokenizer straight, when decoding through it is all HF's decode would do: a third of the cost
        # per call, which a batch of 128 streams pays twice a step.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        plain = backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True)
        self.tokenizer = backend if plain else tokenizer
        self.skip_special = skip_special_tokens
        self.stop = stop
        self.include_stop = include_stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.ids = list(prompt_ids[-6:])  # a little prompt context so the first word's spacing is right
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.emitted = 0

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def add(self, token_id: int) -> tuple[str, str | None]:
        """Append one token; return the text now safe to stream and the stop string hit, if any."""
        self.ids.append(token_id)
        prefix = self.decode(self.ids[self.prefix_offset:self.read_offset])
        full = self.decode(self.ids[self.prefix_offset:])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return "", None
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        start = max(0, len(self.text) - self.hold)
        self.text += full[len(prefix):]
        for stop in self.stop:
            at = self.text.find(stop, start)
            if at >= 0:
                self.text = self.text[:at + len(stop) if self.include_stop else at]
                return self.flush(), stop
        return self.release(len(self.text) - self.hold), None

    def release(self, end: int) -> str:
        if end <= self.emitted:
            return ""
        diff, self.emitted = self.text[self.emitted:end], end
        return diff

    def flush(self) -> str:
        """The held-back tail, once the request has finished."""
        return self.release(len(self.text))
