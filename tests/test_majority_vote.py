"""TTRL's majority-vote reward by name (`majority_vote`, arXiv 2504.16084): hand-worked groups, a reference vote
written independently (groupby + sorted counts), TRL's call signature, and one GRPO step through the registry name."""

from __future__ import annotations

import itertools
import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_stable.papers import PAPERS
from hf_stable.rewards import REWARD_FUNCTIONS, last_boxed_or_text, majority_vote
from hf_stable.rewards.resolve import resolve_reward_function


def _reference(prompts, answers):
    """Per run of equal prompts: the answers with the top non-empty count, the earliest of them wins."""
    out, i = [], 0
    for _, run in itertools.groupby(prompts):
        n = len(list(run))
        group = answers[i : i + n]
        candidates = sorted({a for a in group if a}, key=lambda a: (-group.count(a), group.index(a)))
        out += [float(bool(candidates) and a == candidates[0]) for a in group]
        i += n
    return out


def test_registered_by_name_with_its_paper():
    method = REWARD_FUNCTIONS.get("majority_vote")
    assert method.fn is majority_vote and method.paper is PAPERS["ttrl"]
    assert method.url == "https://arxiv.org/abs/2504.16084"
    assert resolve_reward_function("majority_vote") is majority_vote


def test_hand_worked_groups():
    prompts = ["1+1="] * 4 + ["2+2="] * 4 + ["3+3="] + ["4+4="] * 3
    completions = [
        "2", "3", " 2 ", "2",  # "2" three times
        "5", "4", "4", "5",  # 2-2 tie: "5" was seen first
        "6",  # a group of one votes for itself
        "", "  ", "",  # only empty answers: nobody is the majority
    ]  # fmt: skip
    expected = [1, 0, 1, 1, 1, 0, 0, 1, 1, 0, 0, 0]
    assert majority_vote(prompts, completions) == [float(e) for e in expected]
    # empty answers never win, even when the most common
    assert majority_vote(["p"] * 4, ["", "", "", "7"]) == [0.0, 0.0, 0.0, 1.0]
    assert majority_vote([], []) == []


def test_boxed_answers_and_chat_messages():
    assert last_boxed_or_text(r"so \boxed{3} then \boxed{\frac{1}{2}} done") == r"\frac{1}{2}"
    assert last_boxed_or_text(" 42 ") == "42" and last_boxed_or_text(r"\boxed{4") == r"\boxed{4"
    chat = [[{"role": "user", "content": "q"}]] * 3
    completions = [
        [{"role": "assistant", "content": r"first \boxed{4}"}],
        [{"role": "assistant", "content": r"\boxed{ 5 }"}],
        [{"role": "assistant", "content": r"again \boxed{4}."}],
    ]
    assert majority_vote(chat, completions) == [1.0, 0.0, 1.0]


def test_refuses_mismatched_lengths():
    with pytest.raises(ValueError, match="majority_vote: 2 prompts for 3 completions"):
        majority_vote(["a", "a"], ["1", "1", "2"])


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 6), min_size=1, max_size=5),
    seed=st.integers(0, 10_000),
)
def test_matches_an_independent_vote(sizes, seed):
    rng = random.Random(seed)
    prompts = [f"q{g}" for g, n in enumerate(sizes) for _ in range(n)]
    answers = [rng.choice(["", "1", "2", "3"]) for _ in prompts]
    assert majority_vote(prompts, answers) == _reference(prompts, answers)


def test_trl_call_signature_and_one_grpo_step(tmp_path):
    """Through the registry name in a real GRPO step: TRL's keywords are accepted, its groups are the prompt runs of
    length G, the rewards equal the reference vote, and the policy moves."""
    from grpo_helpers import G, grpo_run

    seen = []

    def recorded(prompts, completions, **kwargs):
        rewards = resolve_reward_function("majority_vote")(prompts=prompts, completions=completions, **kwargs)
        seen.append((list(prompts), list(completions), set(kwargs), rewards))
        return rewards

    delta, _ = grpo_run(tmp_path, reward_funcs=(recorded,))
    prompts, completions, keywords, rewards = seen[0]
    assert {"completion_ids", "trainer_state"} <= keywords
    assert [len(list(run)) for _, run in itertools.groupby(prompts)] == [G] * (len(prompts) // G)
    assert rewards == _reference(prompts, [c.strip() for c in completions])
    assert 0 < sum(rewards) < len(rewards) and delta.abs().max() > 0


# a batch of 3 groups of 4 over 2 processes (6 completions each): the middle group is split, and its halves alone
# would each vote for their first-seen answer ("7" on rank 0, "8" on rank 1) where the whole group votes "8"
SPLIT_PROMPTS = ["a"] * 4 + ["b"] * 4 + ["c"] * 4
SPLIT_ANSWERS = ["1", "1", "2", "3", "7", "8", "8", "9", "", "5", "5", "6"]


def _split_worker(rank, world_size, init_file, out_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    n = len(SPLIT_PROMPTS) // world_size
    local = slice(rank * n, (rank + 1) * n)
    rewards = majority_vote(SPLIT_PROMPTS[local], SPLIT_ANSWERS[local])
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(rewards, f)
    dist.destroy_process_group()


@pytest.mark.distributed
def test_a_group_split_across_processes_votes_as_one(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_split_worker, args=(2, str(tmp_path / "pg"), str(tmp_path)), nprocs=2, join=True)
    gathered = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    expected = _reference(SPLIT_PROMPTS, SPLIT_ANSWERS)
    assert gathered[0] + gathered[1] == expected
    assert expected[4:8] == [0.0, 1.0, 1.0, 0.0]
    assert majority_vote(SPLIT_PROMPTS[:6], SPLIT_ANSWERS[:6])[4:] == [1.0, 0.0]  # what rank 0 alone would give
