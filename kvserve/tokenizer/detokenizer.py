"""Incremental detokenization with stop strings, for streaming generated text.

The engine produces output token ids a few at a time; :class:`IncrementalDetokenizer` turns them into
text with the ``tokenizers`` library's :class:`tokenizers.decoders.DecodeStream`, which buffers tokens
until their bytes form complete UTF-8 characters, so no piece of text ever ends in half a character.
Stop strings (``SamplingParams.stop``) are matched on the text as it grows; while a request runs, the
last ``longest stop string - 1`` characters are held back from the stream, so a client never sees a
fragment of a stop string that later turns out to match.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from kvserve.sampling_params import SamplingParams

# How many prompt tokens prime the decode stream. Decoders such as SentencePiece's Metaspace strip the
# leading space of the first token of a text; seeded with the prompt's tail, the stream decodes the first
# output token as a continuation instead (" world", not "world"). A handful of tokens is enough context
# for every decoder in ``tokenizers`` (each looks at most one token back); vLLM uses 5 as well.
_PROMPT_CONTEXT_TOKENS = 5

# What a lossy UTF-8 decode puts in place of an incomplete byte sequence.
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text, one step at a time.

    Lengths and offsets are in characters (Unicode code points) of ``output_text``.

    Attributes:
        output_text: all text so far; once a stop string matched, it ends right before that match (the
            stop string itself is not included, as in OpenAI's API and vLLM), or right after it with
            ``include_stop_str_in_output``.
        output_token_ids: every token id given to :meth:`update` before a stop string matched.
        stop_string: the stop string that matched, or None.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Prepare to detokenize the output of one sequence.

        Args:
            tokenizer: the model's ``tokenizers.Tokenizer`` (``PreTrainedTokenizerFast.backend_tokenizer``).
            prompt_token_ids: the prompt; only its last few tokens are used, as decoding context.
            params: the request's parameters; ``stop``, ``skip_special_tokens`` and ``min_tokens`` are read.
        """
        self._tokenizer = tokenizer
        self._skip_special_tokens = params.skip_special_tokens
        # dict.fromkeys: drop duplicates but keep the user's order.
        self._stops: list[str] = list(dict.fromkeys(params.stop))
        self._max_stop_len = max((len(s) for s in self._stops), default=0)
        # A stop string can only be completed by text still to come if it began in the last
        # (max_stop_len - 1) characters, so exactly that much must be held back from the stream; with
        # include_stop_str_in_output nothing is cut, so nothing is held back (as vLLM).
        self._include_stop = params.include_stop_str_in_output
        self._hold_back = 0 if self._include_stop else max(self._max_stop_len - 1, 0)
        self._min_tokens = params.min_tokens

        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        # A prompt given as token ids may end in the middle of a UTF-8 character. Seeded with such a tail,
        # DecodeStream (0.23) emits the whole context as soon as the character completes; without a seed
        # it emits what a plain decode of the output gives, so drop the context in that case.
        if context and self._decode(context).endswith(_REPLACEMENT_CHAR):
            context = []
        self._context_ids = context
        self._stream = DecodeStream(context or None, skip_special_tokens=self._skip_special_tokens)

        self.output_text = ""
        self.output_token_ids: list[int] = []
        self.stop_string: str | None = None
        # Tokens fed to the stream since it last returned text (an incomplete character, or special
        # tokens that are skipped); they are flushed by a full decode when the sequence finishes.
        self._num_pending_tokens = 0
        self._finished = False
        # End of the text already returned by get_next_output_text(delta=True).
        self._sent_offset = 0

    def update(self, new_token_ids: Sequence[int]) -> str | None:
        """Detokenize new tokens, append text, check stop strings; return the matched stop string or None.

        Tokens are processed one at a time and stop strings checked after each, so the result does not
        depend on how tokens are grouped into calls; tokens after the one that completed a stop string are
        dropped. A match counts only once at least ``min_tokens`` output tokens (this one included) were
        generated, as for EOS in ``kvserve.core.stop_checker``. Once a stop string matched, or once
        :meth:`get_next_output_text` was called with ``finished=True``, further calls do nothing and
        return None.

        Args:
            new_token_ids: the token ids generated since the last call, oldest first.

        Returns:
            The stop string that matched (``output_text`` is then cut right before it), or None.

        Raises:
            Exception: whatever ``tokenizers`` raises when the decoder fails (the library uses the plain
                ``Exception`` type); unknown ids decode to nothing rather than raising.
        """
        if self.stop_string is not None or self._finished:
            return None
        for token_id in new_token_ids:
            self.output_token_ids.append(token_id)
            piece = self._stream.step(self._tokenizer, token_id)
            if not piece:
                # None: the bytes so far end inside a character (or the token is a skipped special token).
                self._num_pending_tokens += 1
                continue
            self._num_pending_tokens = 0
            if self._append(piece):
                return self.stop_string
        return None

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text to stream to the client.

        While not finished (and no stop string matched), the last (longest stop string length - 1)
        characters are held back, so no fragment of a stop string is ever sent. With ``finished=True`` the
        detokenizer is closed: tokens still waiting in the decode stream (an incomplete character at the
        end, e.g. when ``max_tokens`` cut one) are flushed by a full decode, so that ``output_text`` then
        equals ``tokenizer.decode(output_token_ids)`` (cut at a stop string), and later updates are ignored.

        Args:
            finished: whether the sequence is done (last call for it).
            delta: True: only the text not returned by an earlier ``delta=True`` call; False: all text up
                to the same point.

        Returns:
            The text; may be empty.
        """
        if finished:
            self._finish()
        done = self._finished or self.stop_string is not None
        end = len(self.output_text) if done else max(len(self.output_text) - self._hold_back, 0)
        if not delta:
            return self.output_text[:end]
        # end >= _sent_offset always holds: a stop match starts inside the held-back tail, so cutting at it
        # never reaches text already sent. The guard keeps a delta from ever going backwards regardless.
        if end <= self._sent_offset:
            return ""
        text = self.output_text[self._sent_offset:end]
        self._sent_offset = end
        return text

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def _append(self, piece: str) -> bool:
        """Append ``piece`` to ``output_text`` and look for a stop string that ends inside it.

        Returns True when one matched; ``output_text`` is then cut at its start and ``stop_string`` set.
        """
        old_len = len(self.output_text)
        self.output_text += piece
        if not self._stops or len(self.output_token_ids) < self._min_tokens:
            return False
        text = self.output_text
        best: tuple[int, int, str] | None = None  # (start, length, stop string)
        for stop in self._stops:
            # Only a match that ends in the new piece is new: it starts at most len(stop) - 1 characters
            # before it, so the search never rescans old text (all starts >= old_len - max_stop_len + 1).
            start = text.find(stop, max(old_len - len(stop) + 1, 0))
            # Earliest start wins; on a tie the shorter one, which was complete first.
            if start != -1 and (best is None or (start, len(stop)) < best[:2]):
                best = (start, len(stop), stop)
        if best is None:
            return False
        self.output_text = text[: best[0] + (best[1] if self._include_stop else 0)]
        self.stop_string = best[2]
        return True

    def _finish(self) -> None:
        if self._finished:
            return
        self._finished = True
        if self.stop_string is not None or self._num_pending_tokens == 0:
            return
        # Decode context + output in full and take what the stream has not produced yet: the lossy decode
        # turns an incomplete trailing character into U+FFFD, exactly as tokenizer.decode does.
        base = self._decode(self._context_ids)
        full = self._decode(self._context_ids + self.output_token_ids)
        produced = base + self.output_text
        # Only byte-level-like decoders are guaranteed to extend the text they produced; for any other,
        # keep what was streamed rather than append a guess.
        if full.startswith(produced) and len(full) > len(produced):
            self._append(full[len(produced):])
        self._num_pending_tokens = 0
