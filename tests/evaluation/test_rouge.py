"""ROUGE-1 / ROUGE-L and the Porter stemmer against the `rouge_score` package (and NLTK's stemmer it uses)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_stable.evaluation.rouge import porter_stem, rouge_l, rouge_n, rouge_tokenize


rouge_scorer = pytest.importorskip("rouge_score.rouge_scorer")
porter = pytest.importorskip("nltk.stem.porter")

# words that exercise every Porter step and NLTK's extensions (irregular forms, -ies/-ied on short words, -alli,
# -logi, y after a vowel, double consonants, *o)
TRICKY = """caresses ponies ties cats feed agreed plastered bled motoring sing conflated troubled sized hopping tanned
falling hissing fizzed failing filing happy sky skies enjoy by relational conditional rational valenci hesitanci
digitizer conformabli radicalli differentli vileli analogousli vietnamization predication operator feudalism
decisiveness hopefulness callousness formaliti sensitiviti sensibiliti triplicate formative formalize electriciti
electrical hopeful goodness revival allowance inference airliner gyroscopic adjustable defensible irritant
replacement adjustment dependent adoption homologou communism activate angulariti homologous effective bowdlerize
probate rate cease controll roll dying lying tying news innings outings cannings howe proceed exceed succeed died
cried spied generically archaeology analogies syzygy toy yyyy eyed played oats trees ivy troubles private oaten
orrery authors authored authorship biographies""".split()

VOCAB = TRICKY + "the a of and in to is was he she it fact answer question 42 1999 x9 re-run e-mail".split()


def _scorer():
    return rouge_scorer.RougeScorer(["rouge1", "rougeL"], use_stemmer=True)


def test_stemmer_matches_nltk_on_tricky_words():
    stemmer = porter.PorterStemmer()
    assert [porter_stem(w) for w in TRICKY] == [stemmer.stem(w) for w in TRICKY]


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet="aeiouybcdlmnrstgzwx", min_size=1, max_size=14))
def test_stemmer_matches_nltk_on_random_letter_strings(word):
    assert porter_stem(word) == porter.PorterStemmer().stem(word)


def test_hand_worked_rouge_l():
    # tokens: target [the, cat, sat, on, the, mat], prediction [the, cat, on, mat]; LCS 4
    score = rouge_l("The cat sat on the mat.", "the cat, on mat")
    assert score.recall == pytest.approx(4 / 6) and score.precision == 1.0
    assert score.fmeasure == pytest.approx(2 * (4 / 6) / (1 + 4 / 6))
    assert rouge_l("", "anything") == (0.0, 0.0, 0.0) and rouge_l("anything", "!!!") == (0.0, 0.0, 0.0)
    assert rouge_tokenize("Authors' biographies, 1999!") == ["author", "biographi", "1999"]


texts = st.lists(st.sampled_from(VOCAB), max_size=25).map(" ".join)
noisy = st.text(alphabet="abcXYZ019 .,;'-éß\n", max_size=40)


@settings(max_examples=300, deadline=None)
@given(target=st.one_of(texts, noisy), prediction=st.one_of(texts, noisy))
def test_equals_rouge_score_package(target, prediction):
    """Exact equality (not approx) of precision, recall and F1 for rougeL and rouge1."""
    expected = _scorer().score(target, prediction)
    assert tuple(rouge_l(target, prediction)) == tuple(expected["rougeL"])
    assert tuple(rouge_n(target, prediction, 1)) == tuple(expected["rouge1"])


def test_rouge_n_rejects_bad_n():
    with pytest.raises(ValueError, match="`n`"):
        rouge_n("a", "a", 0)
