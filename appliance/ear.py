"""Replies made for the ear: the clean-up stage between the LLM's text and Piper.

Two parts:

- :class:`EarFilter` works on the token stream, line by line, before the sentence splitter: it drops code
  blocks and table separator rows, takes the markers off list items, headings and quotes, and ends such a
  line with a full stop so that each item is its own sentence ("1. Apples" would otherwise be cut after
  "1." and read as "one.").
- :func:`for_the_ear` rewrites one clause (stateless, idempotent) into words Piper says well: markdown
  emphasis, links, URLs, emoji, units, currency and a few symbols.

What Piper's phonemiser (espeak-ng) already reads well is left alone, checked in ``tests/test_ear.py``:
"50 %", "Dr.", "Mr.", "e.g.", "etc.", "i.e.", "1,000,000", "3.14", "1st", "8:30", "-5", "×", "±", "=",
"&" and e-mail addresses. What it reads badly is rewritten: "$3" ("dollar three"), "€5", "5 °C" ("five
degrees see"), "10 km/h" ("K M slash H"), "5 kg", "2026-12-01" ("… dash twelve dash …"), "5-10" ("five
dash ten"), "1/2", "~5" ("tilde five"), "#1" ("hash one"), "vs." ("V S"), "approx.", URLs ("H T T P S
colon slash slash W W W …").
"""

from __future__ import annotations

import re

MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December")

# --- inline rules (one clause) ---
_CODE_FENCE = re.compile(r"`{3,}\w*|~{3,}")
_INLINE_CODE = re.compile(r"`([^`]*)`")
_IMAGE = re.compile(r"!\[([^\]]*)\]\([^)]*\)")
_LINK = re.compile(r"\[([^\]]+)\]\([^)]*\)")
_HTML = re.compile(r"</?[A-Za-z][^>]*>")
_URL = re.compile(r"\b(?:https?://|www\.)[^\s<>()\[\]]+", re.IGNORECASE)
_LINE_MARK = re.compile(r"^\s*(?:#{1,6}\s+|>\s*|[-*+•]\s+|\d{1,3}[.)]\s+)")
_EMPHASIS = re.compile(r"(?<![\w*_~])(\*{1,3}|_{1,3}|~~)(?=\S)(.+?)(?<=\S)\1(?![\w*_~])")
# Emoji and pictographs, with their joiners, variation selectors, keycaps and tags.
_EMOJI = re.compile("[\U0001F000-\U0001FAFF\u2600-\u27BF\u2B00-\u2BFF\u2300-\u23FF\uFE0E\uFE0F\u200D\u20E3"
                    "\U000E0020-\U000E007F\u2122\u00A9\u00AE]")
_ISO_DATE = re.compile(r"\b(\d{4})-(\d{2})-(\d{2})\b")
_CURRENCY = re.compile(r"([$€£])\s?(\d{1,3}(?:,\d{3})+|\d+)(?:\.(\d{1,2}))?(\s?(?:thousand|million|billion|trillion)\b)?")
_CURRENCY_NAMES = {"$": ("dollar", "dollars", "cent", "cents"), "€": ("euro", "euros", "cent", "cents"),
                   "£": ("pound", "pounds", "penny", "pence")}
_TEMPERATURE = re.compile(r"(\d)\s?°\s?([CF])\b")
_NUMBER = r"\d+(?:[.,]\d+)*"
# Units after a number. Multi-letter units may follow the number directly ("10km"); single letters need a
# space ("5 m"), so that "1990s" and "10x" keep their meaning.
_UNITS = {
    "km/h": ("kilometer per hour", "kilometers per hour"), "kph": ("kilometer per hour", "kilometers per hour"),
    "mph": ("mile per hour", "miles per hour"), "m/s": ("meter per second", "meters per second"),
    "km": ("kilometer", "kilometers"), "cm": ("centimeter", "centimeters"), "mm": ("millimeter", "millimeters"),
    "kg": ("kilogram", "kilograms"), "mg": ("milligram", "milligrams"), "ml": ("milliliter", "milliliters"),
    "mL": ("milliliter", "milliliters"), "kWh": ("kilowatt hour", "kilowatt hours"), "kW": ("kilowatt", "kilowatts"),
    "GHz": ("gigahertz", "gigahertz"), "MHz": ("megahertz", "megahertz"), "kHz": ("kilohertz", "kilohertz"),
    "Hz": ("hertz", "hertz"), "GB": ("gigabyte", "gigabytes"), "MB": ("megabyte", "megabytes"),
    "TB": ("terabyte", "terabytes"), "ft": ("foot", "feet"), "oz": ("ounce", "ounces"), "mi": ("mile", "miles"),
    "min": ("minute", "minutes"), "mins": ("minute", "minutes"), "hrs": ("hour", "hours"), "hr": ("hour", "hours"),
    "sec": ("second", "seconds"), "ms": ("millisecond", "milliseconds"), "lbs": ("pound", "pounds"),
}
_SHORT_UNITS = {"m": ("meter", "meters"), "g": ("gram", "grams"), "l": ("liter", "liters"), "L": ("liter", "liters"),
                "h": ("hour", "hours"), "s": ("second", "seconds"), "W": ("watt", "watts"), "V": ("volt", "volts")}
_UNIT = re.compile(rf"({_NUMBER})(?:\s?({'|'.join(re.escape(u) for u in sorted(_UNITS, key=len, reverse=True))})"
                   rf"|\s({'|'.join(_SHORT_UNITS)}))(?![\w/])")
_RANGE = re.compile(rf"(?<![\d.,:/-])({_NUMBER})\s?(?:–|-|—)\s?({_NUMBER})(?![\d:/-])")
_FRACTIONS = {"1/2": "one half", "1/3": "one third", "2/3": "two thirds", "1/4": "a quarter",
              "3/4": "three quarters", "24/7": "twenty four seven"}
_FRACTION = re.compile(r"(?<![\d/])(1/2|1/3|2/3|1/4|3/4|24/7)(?![\d/])")
_WORDS = [
    (re.compile(r"\bvs\.?(?=\s)"), "versus"),
    (re.compile(r"\bapprox\.(?=\s|$)"), "approximately"),
    (re.compile(r"\bMt\.(?=\s)"), "Mount"),
    (re.compile(r"\bAve\.(?=\s|$)"), "Avenue"),
    (re.compile(r"\bFig\.(?=\s)"), "Figure"),
    (re.compile(r"\bNo\.\s?(?=\d)"), "number "),
    (re.compile(r"#(?=\d)"), "number "),
    (re.compile(r"\bw/(?=\s)"), "with"),
    (re.compile(r"\band/or\b"), "and or"),
    (re.compile(r"~\s?(?=\d)"), "about "),
    (re.compile(r"(?<=\d)\s?\*\s?(?=\d)"), " times "),
    (re.compile(r"(?<=\d)x\b"), " times"),
    (re.compile(r"\s?(?:→|->|=>)\s?"), " to "),
    (re.compile(r"(?<=\d)\s?<\s?(?=\d)"), " is less than "),
    (re.compile(r"(?<=\d)\s?>\s?(?=\d)"), " is more than "),
]
_STRAY_MARKS = re.compile(r"[*_#`|<>^\\]+|~+|\[|\]")


def _plural(number: str, names: tuple[str, str]) -> str:
    return names[0] if number in ("1", "1.0") else names[1]


def _currency(m: re.Match) -> str:
    symbol, whole, cents, scale = m.group(1), m.group(2), m.group(3), (m.group(4) or "").strip()
    one, many, cent, cents_name = _CURRENCY_NAMES[symbol]
    if scale:
        number = whole + (f".{cents}" if cents else "")
        return f"{number} {scale} {many}"
    if cents and int(cents) and whole.replace(",", "") == "0":
        n = str(int(cents if len(cents) == 2 else cents + "0"))
        return f"{n} {cent if n == '1' else cents_name}"
    text = f"{whole} {one if whole == '1' else many}"
    if cents and int(cents):
        text += f" {int(cents if len(cents) == 2 else cents + '0')}"
    return text


def _unit(m: re.Match) -> str:
    number, unit = m.group(1), m.group(2) or m.group(3)
    names = _UNITS.get(unit) or _SHORT_UNITS[unit]
    return f"{number} {_plural(number, names)}"


def _iso_date(m: re.Match) -> str:
    year, month, day = int(m.group(1)), int(m.group(2)), int(m.group(3))
    if not (1 <= month <= 12 and 1 <= day <= 31):
        return m.group(0)
    return f"{MONTHS[month - 1]} {day}, {year}"


def _url(m: re.Match) -> str:
    url = m.group(0)
    trail = re.search(r"[.,;:!?'\"]+$", url)
    tail = trail.group(0) if trail else ""
    url = url[: len(url) - len(tail)]
    host = re.sub(r"^(?:https?://)?(?:www\.)?", "", url, flags=re.IGNORECASE).split("/")[0].split("?")[0]
    return host + tail


def for_the_ear(text: str) -> str:
    """One clause (or line) of a reply as words Piper says well.

    Markdown marks, code fences and HTML tags go; a link keeps its text, an image its alt text, a URL its
    domain; emoji go; currency, temperatures, units after a number, ISO dates, numeric ranges, common
    fractions and a few symbols and abbreviations become words. A unit used as an adjective keeps the
    plural ("a 5 minutes walk"). Idempotent:
    ``for_the_ear(for_the_ear(t)) == for_the_ear(t)``.

    :param text: any text, one clause or more.
    :returns: the text to synthesise, white space collapsed ("" if nothing is left to say).
    """
    text = _CODE_FENCE.sub(" ", text)
    text = _INLINE_CODE.sub(r"\1", text)
    text = _IMAGE.sub(r"\1", text)
    text = _LINK.sub(r"\1", text)
    text = _HTML.sub(" ", text)
    text = _URL.sub(_url, text)
    text = _LINE_MARK.sub("", text)
    for _ in range(2):  # nested emphasis (***bold italic***, **a _b_**)
        text = _EMPHASIS.sub(r"\2", text)
    text = _EMOJI.sub(" ", text)
    text = _ISO_DATE.sub(_iso_date, text)
    text = _CURRENCY.sub(_currency, text)
    text = _TEMPERATURE.sub(lambda m: f"{m.group(1)} degrees {'Celsius' if m.group(2) == 'C' else 'Fahrenheit'}", text)
    text = _FRACTION.sub(lambda m: _FRACTIONS[m.group(1)], text)
    text = _UNIT.sub(_unit, text)
    text = _RANGE.sub(r"\1 to \2", text)
    for pattern, words in _WORDS:
        text = pattern.sub(words, text)
    text = _STRAY_MARKS.sub(" ", text)
    text = re.sub(r"\s+", " ", text).strip()
    text = re.sub(r"\s+([.,;:!?])", r"\1", text)
    return text


# --- the line stage (token stream) ---
_FENCE_LINE = re.compile(r"^\s*(```|~~~)")
_TABLE_SEPARATOR = re.compile(r"^\s*\|?\s*:?-{2,}:?\s*(\|\s*:?-{2,}:?\s*)*\|?\s*$")
_RULE_LINE = re.compile(r"^\s*([-*_])(\s*\1){2,}\s*$")
_ITEM_LINE = re.compile(r"^\s*(?:#{1,6}\s+|>\s*|[-*+•]\s+|\d{1,3}[.)]\s+)")
LINE_HEAD_CHARS = 6  # characters of a line seen before its start is passed on (enough for "123. " or "### ")


class EarFilter:
    """The line-level part of the stage, on the LLM's token stream (before the sentence splitter).

    :meth:`feed` returns the text that is ready (possibly ""), holding back at most the first
    :data:`LINE_HEAD_CHARS` characters of a line until its kind is known, or a whole line inside a code
    block or a table.
    """

    def __init__(self):
        self._buf = ""
        self._line_start = True
        self._in_code = False
        self._item = False  # the current line is a list item, heading or quote: it ends with a stop
        self._last = ""  # the last character passed on

    def feed(self, piece: str) -> str:
        self._buf += piece
        out: list[str] = []
        while self._buf:
            if self._line_start:
                nl = self._buf.find("\n")
                head = self._buf if nl < 0 else self._buf[:nl]
                whole_line = nl >= 0
                if self._in_code or _FENCE_LINE.match(head) or head.lstrip().startswith("|"):
                    if not whole_line:
                        break  # need the whole line
                    self._buf = self._buf[nl + 1:]
                    if _FENCE_LINE.match(head):
                        self._in_code = not self._in_code
                    elif not self._in_code:
                        out.append(self._table_row(head))
                    continue
                if not whole_line and len(head.lstrip()) < LINE_HEAD_CHARS:
                    break
                if _RULE_LINE.match(head) and whole_line:
                    self._buf = self._buf[nl + 1:]
                    continue
                m = _ITEM_LINE.match(head)
                self._item = bool(m)
                if m:
                    self._buf = self._buf[m.end():]
                self._line_start = False
                continue
            nl = self._buf.find("\n")
            if nl < 0:
                out.append(self._emit(self._buf))
                self._buf = ""
                break
            out.append(self._emit(self._buf[:nl]))
            out.append(self._end_line())
            self._buf = self._buf[nl + 1:]
        return "".join(out)

    def flush(self) -> str:
        """The rest, at the end of the reply (an unclosed code block is dropped)."""
        rest, self._buf = self._buf, ""
        if self._in_code:
            self._in_code = False
            return ""
        out = self.feed(rest + "\n") if rest else ""
        if not self._line_start:  # the last line had no newline: end it (a list item gets its stop)
            out += self._end_line()
        self._buf = ""  # (an unclosed code fence swallowed its line)
        return out

    def _emit(self, text: str) -> str:
        if text.strip():
            self._last = text.rstrip()[-1]
        return text

    def _end_line(self) -> str:
        end = "\n"
        if self._item and self._last and self._last not in ".!?:;,":
            end = ".\n"
        self._line_start, self._item, self._last = True, False, ""
        return end

    def _table_row(self, line: str) -> str:
        if _TABLE_SEPARATOR.match(line):
            return ""
        cells = [c.strip() for c in line.strip().strip("|").split("|") if c.strip()]
        return (", ".join(cells) + ".\n") if cells else ""
