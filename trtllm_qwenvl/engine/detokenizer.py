"""Incremental detokenization with stop strings.

Each step decodes only a short window of recent tokens, so streaming costs O(new tokens), and a trailing
incomplete UTF-8 sequence is held back until its bytes arrive.
"""


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], stop: list[str], skip_special_tokens: bool,
                 include_stop: bool):
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        self.stop = stop
        self.include_stop = include_stop
        self.ids = list(prompt_ids[-6:])  # a little prompt context so the first word's spacing is right
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def add(self, token_id: int) -> tuple[str, str | None]:
        """Append one token; return the new text and the stop string hit, if any."""
        self.ids.append(token_id)
        prefix = self.decode(self.ids[self.prefix_offset:self.read_offset])
        full = self.decode(self.ids[self.prefix_offset:])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return "", None
        new = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self.append(new)

    def append(self, new: str) -> tuple[str, str | None]:
        start = max(0, len(self.text) - max((len(s) for s in self.stop), default=0))
        self.text += new
        for stop in self.stop:
            at = self.text.find(stop, start)
            if at >= 0:
                cut = at + len(stop) if self.include_stop else at
                old_len = len(self.text) - len(new)
                self.text = self.text[:cut]
                return self.text[old_len:] if cut > old_len else "", stop
        return new, None
