"""Incremental detokenisation and stop strings.

Text streams as tokens arrive. Two rules: never emit half a UTF-8 character (byte-level
BPE tokens can split one; the decoder shows that as U+FFFD, so such text waits for the next
token), and a stop string ends the text exactly where it begins (text that could still be
the start of a stop string is held back until it cannot).
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Decodes a growing list of token ids into a growing string.

    Decoding a window that starts a few tokens back (prefix_offset) keeps the result right
    for tokenizers whose pieces depend on their left neighbour (leading-space markers).
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def push(self, token_ids: list[int]) -> str:
        """Add tokens; return the newly complete text (possibly empty)."""
        out = []
        for tid in token_ids:
            self.ids.append(tid)
            prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
            full = self._decode(self.ids[self.prefix_offset:])
            if full.endswith(REPLACEMENT) or len(full) <= len(prefix):
                continue  # an incomplete character (or nothing visible yet): wait
            new = full[len(prefix):]
            out.append(new)
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
        new_text = "".join(out)
        self.text += new_text
        return new_text

    def flush(self) -> str:
        """At the end: whatever is still pending, replacement characters included."""
        full = self._decode(self.ids[self.prefix_offset:])
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        rest = full[len(prefix):] if len(full) > len(prefix) else ""
        self.read_offset = self.prefix_offset = len(self.ids)
        self.text += rest
        return rest


class StopStringFilter:
    """Holds back text that may begin a stop string; cuts the text where one begins."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.pending = ""
        self.stopped = False

    def push(self, text: str) -> str:
        """Feed new text; return what is safe to emit. Sets `stopped` when a stop is found."""
        if self.stopped:
            return ""
        if not self.stops:
            return text
        buf = self.pending + text
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self.pending = ""
            return buf[:cut]
        hold = 0
        for s in self.stops:  # longest suffix of buf that is a proper prefix of a stop string
            for n in range(min(len(s) - 1, len(buf)), 0, -1):
                if buf.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        self.pending = buf[len(buf) - hold:] if hold else ""
        return buf[: len(buf) - hold]

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return "" if self.stopped else out
