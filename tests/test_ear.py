"""Replies made for the ear: the clean-up stage between the LLM and Piper (appliance/ear.py), on a table of
real-looking LLM outputs, and checked against what Piper's phonemiser (espeak-ng, through the bundled
voice) already reads well."""

import pytest

from appliance.ear import EarFilter, for_the_ear
from appliance.speech import spoken
from appliance.speech import Tts

# (what an LLM wrote, what the voice should be given)
TABLE = [
    # markdown
    ("**Rainbows** form when *sunlight* passes through raindrops.",
     "Rainbows form when sunlight passes through raindrops."),
    ("It's ***really*** __important__ to ~~never~~ drink water.", "It's really important to never drink water."),
    ("# Weather today\nIt is sunny.", "Weather today. It is sunny."),
    ("> A quote from the book.\nThat is all.", "A quote from the book. That is all."),
    ("Here are three fruits:\n- Apples\n- Pears\n- Plums", "Here are three fruits: Apples. Pears. Plums."),
    ("Steps:\n1. Boil water\n2. Add pasta\n3) Wait 10 min", "Steps: Boil water. Add pasta. Wait 10 minutes."),
    ("* First point.\n* Second point!", "First point. Second point!"),
    ("Run `ls -la` to list files.", "Run ls -la to list files."),
    ("Like this:\n```python\nprint('hello')\n```\nThen run it.", "Like this: Then run it."),
    ("| City | Temp |\n|---|---|\n| Oslo | 3 °C |", "City, Temp. Oslo, 3 degrees Celsius."),
    ("Read [the guide](https://example.com/guide) first.", "Read the guide first."),
    ("![a cat](cat.png) Cute, isn't it?", "a cat Cute, isn't it?"),
    ("Line one<br>line two", "Line one line two"),
    ("---\nDone.", "Done."),
    # URLs and e-mail addresses
    ("See https://www.wikipedia.org/wiki/Rainbow for more.", "See wikipedia.org for more."),
    ("Visit www.bbc.co.uk/weather.", "Visit bbc.co.uk."),
    ("Write to help@example.com with questions.", "Write to help@example.com with questions."),
    # emoji
    ("Have a great day! 😊🌈", "Have a great day!"),
    ("Good job 👍🏽 and thanks ❤️!", "Good job and thanks!"),
    ("Flags 🇩🇪 and families 👨‍👩‍👧 too.", "Flags and families too."),
    # units and symbols
    ("It is 5 °C in Oslo and 72°F in Miami.", "It is 5 degrees Celsius in Oslo and 72 degrees Fahrenheit in Miami."),
    ("The speed limit is 10 km/h here.", "The speed limit is 10 kilometers per hour here."),
    ("About 50 % of people agree.", "About 50 % of people agree."),
    ("A coffee costs $3, or $3.50 with milk.", "A coffee costs 3 dollars, or 3 dollars 50 with milk."),
    ("It was $1.2 million, €5 or £20.", "It was 1.2 million dollars, 5 euros or 20 pounds."),
    ("Only $0.99 today.", "Only 99 cents today."),
    ("Add 500 ml of milk and 2 kg of flour.", "Add 500 milliliters of milk and 2 kilograms of flour."),
    ("It is 1 km away, 5 min on foot, 3 m high.", "It is 1 kilometer away, 5 minutes on foot, 3 meters high."),
    ("Wi-Fi at 5 GHz, a disk of 2 TB, 60 mph.", "Wi-Fi at 5 gigahertz, a disk of 2 terabytes, 60 miles per hour."),
    ("Open 9-5, about ~20 people, rank #1.", "Open 9 to 5, about about 20 people, rank number 1."),
    ("Use 1/2 cup, it's open 24/7.", "Use one half cup, it's open twenty four seven."),
    ("3 * 4 = 12 and 10x faster.", "3 times 4 = 12 and 10 times faster."),
    ("Red → green, cats vs. dogs, approx. 3.", "Red to green, cats versus dogs, approximately 3."),
    # abbreviations and numbers (left to Piper where it reads them well, see below)
    ("Dr. Smith met Mr. Jones at 8:30.", "Dr. Smith met Mr. Jones at 8:30."),
    ("Fruits, e.g. apples, etc. cost 1,000,000 in total.", "Fruits, e.g. apples, etc. cost 1,000,000 in total."),
    ("Pi is 3.14, and it was the 1st time in the 1990s.", "Pi is 3.14, and it was the 1st time in the 1990s."),
    ("The launch was on 2026-12-01 at -5 degrees.", "The launch was on December 1, 2026 at -5 degrees."),
    ("It happened 1999–2003.", "It happened 1999 to 2003."),
]


@pytest.mark.parametrize("llm, want", TABLE, ids=[t[0][:40] for t in TABLE])
def test_the_table(llm, want):
    assert len(TABLE) >= 30
    assert spoken(llm) == want
    # The same as tokens arrive (pieces of 3 characters), and idempotent (the voice cleans each clause again).
    assert spoken(llm, pieces=3) == want
    assert for_the_ear(want) == want


def test_an_unclosed_code_block_is_not_read():
    f = EarFilter()
    assert f.feed("Try this:\n```\nrm -rf /\nmore code") == "Try this:\n"
    assert f.flush() == ""


@pytest.fixture(scope="module")
def phonemes():
    voice = Tts().voice
    # Compared without stress marks, word breaks and the flap allophone of t (joined words flap: "at
    # example" → "æɾ").
    table = str.maketrans({"ˈ": None, "ˌ": None, " ": None, ".": None, "ʲ": None, "ɾ": "t"})
    return lambda text: " ".join("".join(s) for s in voice.phonemize(text)).translate(table)


# What Piper's phonemiser already reads well: the stage leaves these alone.
PIPER_READS_WELL = [
    ("50 %", "50 percent"), ("Dr. Smith", "Doctor Smith"), ("Mr. Smith", "Mister Smith"),
    ("e.g. apples", "for example apples"), ("1,000,000", "1000000"), ("1st", "first"),
    ("it is 8:30", "it is eight thirty"), ("-5", "minus 5"), ("3 × 4", "3 times 4"),
    ("±2", "plus or minus 2"), ("x = 3", "x equals 3"), ("cats & dogs", "cats and dogs"),
    ("john.doe@example.com", "john dot doe at example dot com"),
]
# What it reads badly (the raw text's phonemes differ from the words): the stage rewrites these.
PIPER_READS_BADLY = ["$3", "€5", "5 °C", "10 km/h", "5 kg", "2 km", "2026-12-01", "5-10", "1/2", "~5", "#1",
                     "vs. them", "approx. 3", "30 min", "https://www.example.com/docs"]


@pytest.mark.parametrize("raw, words", PIPER_READS_WELL)
def test_left_alone_because_piper_reads_it_well(phonemes, raw, words):
    assert for_the_ear(raw) == raw
    assert phonemes(raw) == phonemes(words)


@pytest.mark.parametrize("raw", PIPER_READS_BADLY)
def test_rewritten_because_piper_reads_it_badly(phonemes, raw):
    text = for_the_ear(raw)
    assert text != raw
    assert phonemes(raw) != phonemes(text)
