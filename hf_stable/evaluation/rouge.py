"""ROUGE-1 and ROUGE-L between a target and a prediction, equal to Google's `rouge_score` package.

open-unlearning scores generations with ``rouge_scorer.RougeScorer(["rouge1", "rougeL"], use_stemmer=True)
.score(target, prediction)`` (`src/evals/metrics/utils.py`, ``eval_text_similarity``): TOFU reports the ROUGE-L
*recall*, MUSE the ROUGE-L *F1*. This module computes the same numbers without the package (and without NLTK):

* tokenisation as `rouge_score/tokenize.py` (``tokenize``): lower-case, every run of characters outside
  ``[a-z0-9]`` becomes a separator, tokens longer than 3 characters are Porter-stemmed;
* the Porter stemmer in NLTK's default ``NLTK_EXTENSIONS`` mode (`nltk/stem/porter.py`, ``PorterStemmer``), which
  `rouge_score` uses: Porter (1980) "An algorithm for suffix stripping", Program 14(3), with Martin Porter's later
  amendments and NLTK's (irregular forms, ``ies``/``ied`` on 4-letter words, ``y -> i`` only after a consonant, ...);
* ROUGE-L from the longest common subsequence (Lin, 2004, "ROUGE: A Package for Automatic Evaluation of Summaries"),
  ROUGE-1 from clipped unigram counts; precision, recall and F1 are 0 when either side has no token.

Written from reading those files (nothing copied); tests check equality with `rouge_score` on random text.
"""

from __future__ import annotations

import re
from collections import Counter
from functools import lru_cache
from itertools import pairwise
from typing import NamedTuple


__all__ = ["RougeScore", "porter_stem", "rouge_l", "rouge_n", "rouge_tokenize"]

_VOWELS = frozenset("aeiou")
_NON_ALNUM = re.compile(r"[^a-z0-9]+")
# NLTK_EXTENSIONS: whole words mapped before any rule runs
_IRREGULAR = {
    "skies": "sky", "sky": "sky", "dying": "die", "lying": "lie", "tying": "tie", "news": "news",
    "innings": "inning", "inning": "inning", "outings": "outing", "outing": "outing", "cannings": "canning",
    "canning": "canning", "howe": "howe", "proceed": "proceed", "exceed": "exceed", "succeed": "succeed",
}  # fmt: skip


class RougeScore(NamedTuple):
    precision: float
    recall: float
    fmeasure: float


def _consonants(word: str) -> list[bool]:
    """Per letter: a consonant? ``y`` is one at the start and after a vowel (Porter's definition)."""
    flags: list[bool] = []
    for i, ch in enumerate(word):
        flags.append(ch not in _VOWELS and (ch != "y" or i == 0 or not flags[i - 1]))
    return flags


def _measure(stem: str) -> int:
    """Porter's m: the number of vowel-run -> consonant-run transitions in ``stem``."""
    flags = _consonants(stem)
    return sum(1 for a, b in pairwise(flags) if not a and b)


def _has_vowel(stem: str) -> bool:
    return not all(_consonants(stem))


def _double_consonant(word: str) -> bool:
    return len(word) >= 2 and word[-1] == word[-2] and _consonants(word)[-1]


def _cvc(word: str) -> bool:
    """Porter's *o: ends consonant-vowel-consonant, the last not w/x/y (NLTK: or is a 2-letter vowel-consonant)."""
    if len(word) >= 3:
        c = _consonants(word)
        if c[-3] and not c[-2] and c[-1] and word[-1] not in "wxy":
            return True
    return len(word) == 2 and _consonants(word) == [False, True]


def _rules(word: str, rules) -> str:
    """Apply the first rule whose suffix ends ``word``; a failed condition stops the list (Porter's convention)."""
    for suffix, replacement, condition in rules:
        if word.endswith(suffix):
            stem = word[: len(word) - len(suffix)]
            return stem + replacement if condition is None or condition(stem) else word
    return word


def _m_pos(stem: str) -> bool:
    return _measure(stem) > 0


def _m_gt1(stem: str) -> bool:
    return _measure(stem) > 1


_STEP2 = [
    ("ational", "ate"), ("tional", "tion"), ("enci", "ence"), ("anci", "ance"), ("izer", "ize"), ("bli", "ble"),
    ("alli", "al"), ("entli", "ent"), ("eli", "e"), ("ousli", "ous"), ("ization", "ize"), ("ation", "ate"),
    ("ator", "ate"), ("alism", "al"), ("iveness", "ive"), ("fulness", "ful"), ("ousness", "ous"), ("aliti", "al"),
    ("iviti", "ive"), ("biliti", "ble"), ("fulli", "ful"),
]  # fmt: skip
_STEP3 = [("icate", "ic"), ("ative", ""), ("alize", "al"), ("iciti", "ic"), ("ical", "ic"), ("ful", ""), ("ness", "")]
_STEP4 = ["al", "ance", "ence", "er", "ic", "able", "ible", "ant", "ement", "ment", "ent", "ion", "ou", "ism", "ate",
          "iti", "ous", "ive", "ize"]  # fmt: skip


def _step1(word: str) -> str:
    # 1a (NLTK: a 4-letter "-ies" word keeps "ie": ties -> tie)
    if word.endswith("ies") and len(word) == 4:
        word = word[:-1]
    else:
        word = _rules(word, [("sses", "ss", None), ("ies", "i", None), ("ss", "ss", None), ("s", "", None)])
    # 1b
    if word.endswith("ied"):  # NLTK: died -> die, but cried -> cri
        word = word[:-1] if len(word) == 4 else word[:-2]
    elif word.endswith("eed"):
        word = word[:-1] if _measure(word[:-3]) > 0 else word
    else:
        for suffix in ("ed", "ing"):
            if word.endswith(suffix) and _has_vowel(word[: -len(suffix)]):
                stem = word[: -len(suffix)]
                if stem.endswith(("at", "bl", "iz")):
                    word = stem + "e"
                elif _double_consonant(stem):
                    word = stem if stem[-1] in "lsz" else stem[:-1]
                else:
                    word = stem + "e" if _measure(stem) == 1 and _cvc(stem) else stem
                break
    # 1c (NLTK: y -> i only after a consonant that is not the whole stem: happy -> happi, enjoy, by)
    if word.endswith("y") and len(word) > 2 and _consonants(word[:-1])[-1]:
        word = word[:-1] + "i"
    return word


def _step2(word: str) -> str:
    if word.endswith("alli") and _m_pos(word[:-4]):  # NLTK: recurse after alli -> al
        return _step2(word[:-4] + "al")
    rules = [(s, r, _m_pos) for s, r in _STEP2]
    rules.append(("logi", "log", lambda _stem: _m_pos(word[:-3])))  # NLTK measures the stem with its "l"
    return _rules(word, rules)


def _step4(word: str) -> str:
    rules = [(s, "", _m_gt1) for s in _STEP4]
    rules[_STEP4.index("ion")] = ("ion", "", lambda stem: _m_gt1(stem) and stem[-1:] in ("s", "t"))
    return _rules(word, rules)


def _step5(word: str) -> str:
    if word.endswith("e"):
        stem = word[:-1]
        m = _measure(stem)
        if m > 1 or (m == 1 and not _cvc(stem)):
            word = stem
    if word.endswith("ll") and _measure(word[:-1]) > 1:
        word = word[:-1]
    return word


@lru_cache(maxsize=65536)
def porter_stem(word: str) -> str:
    """Porter stem of a lower-case ``word``, as NLTK's ``PorterStemmer().stem`` (default mode)."""
    word = word.lower()
    if word in _IRREGULAR:
        return _IRREGULAR[word]
    if len(word) <= 2:
        return word
    word = _step1(word)
    word = _step2(word)
    word = _rules(word, [(s, r, _m_pos) for s, r in _STEP3])
    word = _step4(word)
    return _step5(word)


def rouge_tokenize(text: str, stem: bool = True) -> list[str]:
    """`rouge_score`'s default tokens: lower-case ``[a-z0-9]+`` runs, Porter-stemmed when longer than 3 letters."""
    tokens = [t for t in _NON_ALNUM.sub(" ", text.lower()).split() if t]
    if stem:
        tokens = [porter_stem(t) if len(t) > 3 else t for t in tokens]
    return [t for t in tokens if t]


def _score(overlap: int, n_target: int, n_prediction: int) -> RougeScore:
    if n_target == 0 or n_prediction == 0:
        return RougeScore(0.0, 0.0, 0.0)
    precision, recall = overlap / n_prediction, overlap / n_target
    f1 = 2 * precision * recall / (precision + recall) if precision + recall > 0 else 0.0
    return RougeScore(precision, recall, f1)


def _lcs_length(a: list[str], b: list[str]) -> int:
    """Length of the longest common subsequence, O(len(a) len(b)) time, O(len(b)) memory."""
    previous = [0] * (len(b) + 1)
    for x in a:
        current = [0]
        for j, y in enumerate(b):
            current.append(previous[j] + 1 if x == y else max(previous[j + 1], current[j]))
        previous = current
    return previous[-1]


def rouge_l(target: str, prediction: str, stem: bool = True) -> RougeScore:
    """ROUGE-L of ``prediction`` against ``target``: ``recall = LCS / |target|``, ``precision = LCS / |prediction|``
    (token counts), F1 their harmonic mean; all 0 when either text has no token. Equals
    ``RougeScorer(["rougeL"], use_stemmer=stem).score(target, prediction)["rougeL"]``."""
    t, p = rouge_tokenize(target, stem), rouge_tokenize(prediction, stem)
    return _score(_lcs_length(t, p) if t and p else 0, len(t), len(p))


def rouge_n(target: str, prediction: str, n: int = 1, stem: bool = True) -> RougeScore:
    """ROUGE-N from clipped n-gram counts; equals `rouge_score`'s ``rouge{n}``."""
    if n < 1:
        raise ValueError(f"`n` must be a positive integer, got {n!r}.")

    def grams(tokens):
        return Counter(tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1))

    t, p = grams(rouge_tokenize(target, stem)), grams(rouge_tokenize(prediction, stem))
    return _score(sum((t & p).values()), sum(t.values()), sum(p.values()))
