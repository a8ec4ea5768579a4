"""Incremental detokenization: new text per generated token, without re-decoding the whole output."""

from __future__ import annotations

from engine.core.sequence import Sequence


class Detokenizer:
    """Decodes a sequence's output tokens as they arrive (special tokens skipped).

    Decoding a window that starts a few tokens back keeps multi-token characters (a UTF-8 byte
    split over tokens) and leading-space handling right; text ending in U+FFFD waits for more.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def step(self, seq: Sequence, final: bool = False) -> str:
        """Append and return the text the newest tokens complete (all of it when `final`)."""
        out = seq.output_token_ids
        prefix = self._decode(out[seq.prefix_offset : seq.read_offset])
        full = self._decode(out[seq.prefix_offset :])
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return ""
        new = full[len(prefix) :]
        seq.prefix_offset, seq.read_offset = seq.read_offset, len(out)
        seq.output_text += new
        return new
