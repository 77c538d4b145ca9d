"""Former location of the unlearning data helpers, now `hf_stable.trainers.unlearning.data`; kept for the imports of
`hf_stable.evaluation.unlearning` until they move."""

from .unlearning.data import _answer_column, pad_stream, tokenize_row, tokenize_rows


__all__ = ["_answer_column", "pad_stream", "tokenize_row", "tokenize_rows"]
