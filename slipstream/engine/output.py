"""OutputProcessor: a sequence's sampled tokens -> its text, logprob entries and stop conditions.

Text grows by decoding a short window of tokens and keeping only what is new, so a
multi-byte character split over tokens is emitted once complete (no U+FFFD halves) and
the cost per token does not grow with the output length. Must never know the scheduler:
the engine frees a sequence this module has finished.
"""
from __future__ import annotations

from slipstream.engine.sequence import Sequence
from slipstream.layers.sampler import SampleResult
from slipstream.outputs import Logprob, TokenLogprobs


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: list[int], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def append(self, seq: Sequence, sample: SampleResult) -> None:
        """Add a sampled token to `seq`: its logprobs, its text, and a finish_reason if it ends the sequence."""
        seq.token_ids.append(sample.token_id)
        if seq.logprobs is not None:
            seq.logprobs.append(self.logprob_entries(sample.token_id, sample.logprob, sample.rank, sample.top))
            seq.cumulative_logprob += sample.logprob
        self._check_stop(seq, self._detokenize(seq))

    def logprob_entries(self, token_id: int, logprob: float, rank: int, top: list[tuple[int, float]]) -> TokenLogprobs:
        entries = {t: Logprob(v, i + 1, self.decode_token(t)) for i, (t, v) in enumerate(top)}
        entries[token_id] = Logprob(logprob, rank, self.decode_token(token_id))
        return entries

    def decode_token(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token_id])

    def _detokenize(self, seq: Sequence) -> str:
        """Append the text of the newest token(s) to seq.output_text; return the new text."""
        if self.tokenizer is None:
            return ""
        skip = seq.params.skip_special_tokens
        window = seq.token_ids[seq.prefix_offset:]
        prefix = self.tokenizer.decode(window[:seq.read_offset - seq.prefix_offset], skip_special_tokens=skip)
        text = self.tokenizer.decode(window, skip_special_tokens=skip)
        if len(text) <= len(prefix) or text.endswith("\ufffd"):
            return ""
        seq.prefix_offset, seq.read_offset = seq.read_offset, seq.num_tokens
        delta = text[len(prefix):]
        seq.output_text += delta
        return delta

    def _check_stop(self, seq: Sequence, new_text: str) -> None:
        """Set seq.finish_reason ('stop' or 'length') if the newest token ends the sequence."""
        p = seq.params
        token = seq.token_ids[-1]
        if seq.num_output_tokens >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                seq.finish_reason = "stop"
                return
            if token in p.stop_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", token
                return
            if new_text and _truncate_at_stop_string(seq, new_text):
                return
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"


def _truncate_at_stop_string(seq: Sequence, new_text: str) -> bool:
    p = seq.params
    for stop in p.stop_list:
        # only a match that overlaps the new text is new; start the search just before it
        begin = max(0, len(seq.output_text) - len(new_text) - len(stop) + 1)
        index = seq.output_text.find(stop, begin)
        if index != -1:
            end = index + len(stop) if p.include_stop_str_in_output else index
            seq.output_text = seq.output_text[:end]
            seq.finish_reason, seq.stop_reason = "stop", stop
            return True
    return False
