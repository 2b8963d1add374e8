"""Strict answer matching: one normalized answer, equal to one accepted form, or wrong.

``normalize(text)``: Unicode NFKC, case-folded, surrounding whitespace and quotes removed, one
trailing ``.``, ``!`` or ``?`` removed, inner whitespace collapsed to one space, and one leading
article (``the``, ``a``, ``an``) dropped. ``is_correct(answer, accepted)`` holds exactly when
the normalized answer equals the normalized form of one accepted answer and is at most
``MAX_ANSWER_CHARS`` long.

Nothing is searched for inside the answer, so padding (``620 or 540``, ``620, 540, 300``, a
sentence around the answer) and hedging (``maybe 620``, ``620?? not sure``, ``I think 620``)
are wrong: unlike a containment match, listing candidates can never collect the reward.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable

MAX_ANSWER_CHARS = 64
_ARTICLE_RE = re.compile(r"^(the|a|an) ")
_QUOTES = "\"'`\u201c\u201d\u2018\u2019"


def normalize(text: str) -> str:
    """The normal form of an answer (see the module docstring)."""
    out = unicodedata.normalize("NFKC", text).casefold().strip().strip(_QUOTES).strip()
    if out[-1:] in (".", "!", "?"):
        out = out[:-1].rstrip()
    out = " ".join(out.split())
    return _ARTICLE_RE.sub("", out, count=1)


def is_correct(answer: str, accepted: Iterable[str]) -> bool:
    """Whether ``answer`` is exactly one accepted answer up to normalization."""
    if not isinstance(answer, str):
        return False
    norm = normalize(answer)
    if not norm or len(norm) > MAX_ANSWER_CHARS:
        return False
    return norm in {normalize(a) for a in accepted}
