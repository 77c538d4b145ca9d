"""TinyTOFU: a seeded, download-free unlearning benchmark (fictitious authors, a word-level tokenizer, a 0.4M Llama).

Modelled on TOFU (Maini et al., arXiv 2401.06121); the design and its metrics are described in ``docs/unlearning.md``.
Everything is derived from one integer seed: the author names and facts, the splits, the perturbed (wrong) answers
and the weights.

Version 2 has no per-author token. An author name is three syllable tokens (``"va ren dol"``) drawn from a pool of
24 that every author shares, and each syllable is also an ordinary word of the corpus: the world split holds a
"which word follows <syllable> ?" lexicon in which every syllable is both a question word and an answer. Version 1
gave each author one dedicated token, so re-drawing the 20 forget authors' embedding rows, with no training, removed
their facts and passed every check; with shared tokens that edit also damages the retain authors and the lexicon
(see [`reset_name_embeddings`]).

```python
from hf_stable.testing.tinytofu import make_tinytofu, train_tinytofu, first_token_accuracy
data = make_tinytofu(seed=0)                      # vocabulary, tokenizer and datasets.Dataset splits
full, info = train_tinytofu(data, "full")         # SFT on forget + retain + world, cached on disk
oracle, _ = train_tinytofu(data, "oracle")        # retain + world only, another init seed
first_token_accuracy(full, data.tokenizer, data.forget_eval)   # ~1.0; the oracle sits near chance (~0.07)
```

Rows are ``prompt = "Q: <question words> A:"`` and ``completion = " <value>"`` (plus metadata columns); the EOS is
not in the text: trainers append it when they tokenise (labels on the value and the EOS only). Tokenising
``prompt + completion`` gives the concatenation of the two tokenisations (whitespace pre-tokenizer).

The code lives in three modules, all re-exported here: `tinytofu_data` (splits, tokenizer, model, embedding-reset
control), `tinytofu_eval` (encoding and metrics) and `tinytofu_train` (SFT and its cache).
"""

from .tinytofu_data import (
    ATTRIBUTES,
    DEFAULT_RECIPE,
    DEFAULT_SIZES,
    FORMAT_VERSION,
    MAX_LENGTH,
    REDUCED_EPOCHS,
    REDUCED_SIZES,
    SYLLABLES,
    TinyTofu,
    build_tinytofu_model,
    build_tinytofu_tokenizer,
    make_tinytofu,
    name_token_ids,
    reset_name_embeddings,
)
from .tinytofu_eval import (
    answer_mean_nll,
    answer_prob,
    answer_token_logps,
    encode_split,
    first_token_accuracy,
    first_token_correct,
    perturbed_mean_nll,
    tinytofu_accuracies,
)
from .tinytofu_train import default_cache_dir, train_tinytofu


__all__ = [
    "ATTRIBUTES",
    "DEFAULT_RECIPE",
    "DEFAULT_SIZES",
    "FORMAT_VERSION",
    "MAX_LENGTH",
    "REDUCED_EPOCHS",
    "REDUCED_SIZES",
    "SYLLABLES",
    "TinyTofu",
    "answer_mean_nll",
    "answer_prob",
    "answer_token_logps",
    "build_tinytofu_model",
    "build_tinytofu_tokenizer",
    "default_cache_dir",
    "encode_split",
    "first_token_accuracy",
    "first_token_correct",
    "make_tinytofu",
    "name_token_ids",
    "perturbed_mean_nll",
    "reset_name_embeddings",
    "tinytofu_accuracies",
    "train_tinytofu",
]
