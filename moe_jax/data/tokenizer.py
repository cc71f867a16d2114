"""Tokenizers behind one small interface: raw UTF-8 bytes, or a Hugging Face tokenizer.json.

The byte tokenizer needs no files, so the embedded corpus trains anywhere; a
tokenizer.json brings a real subword vocabulary for prepared token files.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

EOS_TOKENS = ("<|endoftext|>", "</s>", "<eos>", "[EOS]")
BOS_TOKENS = ("<s>", "<bos>", "[BOS]")
PAD_TOKENS = ("<pad>", "[PAD]", "<|pad|>")


class ByteTokenizer:
    """Ids 0..255 are the UTF-8 bytes; 256..258 are BOS, EOS and PAD."""

    name = "byte"
    bos_id = 256
    eos_id = 257
    pad_id = 258
    vocab_size = 259

    def encode(self, text: str) -> np.ndarray:
        """The UTF-8 bytes of `text` as int32 ids (no special tokens added)."""
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [self.encode(text) for text in texts]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Text of the byte ids; special ids are dropped, broken UTF-8 becomes U+FFFD."""
        ids = np.asarray(ids)
        return ids[ids < 256].astype(np.uint8).tobytes().decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer.json with the same interface as ByteTokenizer."""

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer

        try:
            self._tok = Tokenizer.from_file(path)
        except Exception as err:
            reason = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise ValueError(f"tokenizer {path} is not a valid tokenizer.json: {reason}") from None
        self.name = path
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        eos = self._find(EOS_TOKENS)
        if eos is None:
            raise ValueError(
                f"tokenizer {path} has no end-of-text token; looked for {list(EOS_TOKENS)}"
            )
        self.eos_id = eos
        bos = self._find(BOS_TOKENS)
        pad = self._find(PAD_TOKENS)
        # GPT-2 style vocabularies have one special token that serves for all three.
        self.bos_id = eos if bos is None else bos
        self.pad_id = eos if pad is None else pad

    def _find(self, tokens: Sequence[str]) -> int | None:
        for token in tokens:
            token_id = self._tok.token_to_id(token)
            if token_id is not None:
                return token_id
        return None

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, np.int32)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Encodes many documents in parallel (the Rust side uses all cores)."""
        encodings = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, np.int32) for e in encodings]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)


Tokenizer = ByteTokenizer | HFTokenizer


def load_tokenizer(spec: str) -> Tokenizer:
    """'byte' for the byte tokenizer, otherwise the path of a tokenizer.json."""
    if spec == "byte":
        return ByteTokenizer()
    if not os.path.isfile(spec):
        raise ValueError(f"tokenizer {spec!r} is neither 'byte' nor an existing tokenizer.json")
    return HFTokenizer(os.path.abspath(spec))
