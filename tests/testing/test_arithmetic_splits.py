"""`arithmetic_splits`: pairwise disjoint sets of distinct addition problems (a held-out split never shares a prompt
with a training split, unlike two `arithmetic_dataset` draws)."""

import pytest

from hf_stable.testing import arithmetic_dataset, arithmetic_splits


def test_splits_are_distinct_disjoint_and_correct():
    splits = arithmetic_splits({"test": 300, "sft": 800, "rest": None}, seed=3)
    prompts = {name: list(ds["prompt"]) for name, ds in splits.items()}
    assert [len(p) for p in prompts.values()] == [300, 800, 100 * 100 - 1100]
    every = [p for ps in prompts.values() for p in ps]
    assert len(set(every)) == len(every) == 100 * 100  # all problems, each once
    for row in splits["sft"]:
        a, b = map(int, row["prompt"].rstrip("=").split("+"))
        assert row["answer"] == row["completion"] == str(a + b)
    assert arithmetic_splits({"test": 300}, seed=3)["test"]["prompt"] == prompts["test"]  # same seed, same deal
    assert arithmetic_splits({"test": 300}, seed=4)["test"]["prompt"] != prompts["test"]


def test_exclude_keeps_a_split_out():
    test = arithmetic_splits({"test": 50}, seed=0, max_operand=9)["test"]
    train = arithmetic_splits({"train": None}, seed=1, max_operand=9, exclude=test["prompt"])["train"]
    assert len(train) == 50 and not set(train["prompt"]) & set(test["prompt"])


def test_sampled_datasets_overlap_where_splits_do_not():
    """The control that motivates the helper: two `arithmetic_dataset` draws share most problems."""
    shared = set(arithmetic_dataset(300, seed=1234)["prompt"]) & set(arithmetic_dataset(20_000, seed=0)["prompt"])
    assert len(shared) > 200


@pytest.mark.parametrize(
    "sizes, match",
    [({"a": -1}, "sizes must be counts"), ({"a": None, "b": None}, "at most one None"), ({"a": 101}, "ask for 101")],
)
def test_bad_sizes(sizes, match):
    with pytest.raises(ValueError, match=match):
        arithmetic_splits(sizes, max_operand=9)
