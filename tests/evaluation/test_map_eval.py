"""MaP's pure parts and `hf-stable eval`: pass@k equals the binomial formula of Chen et al. 2021 computed with exact
integers, the uniform average equals the mean of the checkpoints, sampling is reproducible and leaves the caller's RNG
alone, and the CLI's result equals an independent merge + evaluation of the last checkpoints."""

import json
import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_stable.evaluation.map_eval import (
    evaluate_pass_at_k,
    last_checkpoints,
    mean_pass_at_k,
    pass_at_k,
    sample_completions,
    uniform_average,
)


def exact_pass_at_k(n, c, k):
    """1 − C(n−c, k)/C(n, k) with integers (math.comb(m, k) = 0 for m < k)."""
    return float(1 - Fraction(math.comb(n - c, k), math.comb(n, k)))


def test_pass_at_k_by_hand():
    # n=5, c=2, k=2: 1 - C(3,2)/C(5,2) = 1 - 3/10; k=1: c/n; n-c < k: 1; c=0: 0
    got = pass_at_k(torch.tensor([5, 5, 5, 5, 4]), torch.tensor([2, 2, 4, 0, 4]), 2)
    assert got.dtype == torch.float64
    assert got.tolist() == pytest.approx([0.7, 0.7, 1.0, 0.0, 1.0], abs=1e-15)
    assert pass_at_k(torch.tensor([5]), torch.tensor([2]), 1).item() == pytest.approx(0.4, abs=1e-15)
    assert pass_at_k(8, torch.tensor([3, 0, 8]), 3).tolist() == pytest.approx(
        [1 - 10 / 56, 0.0, 1.0], abs=1e-15
    )  # C(5,3)=10, C(8,3)=56; a scalar n is broadcast
    assert mean_pass_at_k(torch.tensor([5, 5]), torch.tensor([2, 0]), [1, 2]) == pytest.approx({1: 0.2, 2: 0.35})


def test_pass_at_k_matches_exact_integers_on_a_grid():
    ns, cs, ks = [], [], []
    for n in range(1, 41):
        for c in range(n + 1):
            ns.append(n)
            cs.append(c)
    for k in (1, 2, 5, 16, 40):
        keep = [i for i, n in enumerate(ns) if n >= k]
        n_t, c_t = torch.tensor([ns[i] for i in keep]), torch.tensor([cs[i] for i in keep])
        want = torch.tensor([exact_pass_at_k(ns[i], cs[i], k) for i in keep], dtype=torch.float64)
        torch.testing.assert_close(pass_at_k(n_t, c_t, k), want, atol=1e-13, rtol=0)
        ks.append(k)
    # large n: binomials of 10^4 overflow floats; the product form does not
    big = pass_at_k(torch.tensor([10_000]), torch.tensor([37]), 100).item()
    assert big == pytest.approx(exact_pass_at_k(10_000, 37, 100), abs=1e-12)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 60).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))))
def test_pass_at_k_properties(nck):
    n, c, k = nck
    value = pass_at_k(torch.tensor([n]), torch.tensor([c]), k).item()
    assert 0.0 <= value <= 1.0
    if k == 1:
        assert value == pytest.approx(c / n, abs=1e-14)
    if k < n:  # monotone non-decreasing in k
        assert pass_at_k(torch.tensor([n]), torch.tensor([c]), k + 1).item() >= value - 1e-14
    if c < n:  # and in c
        assert pass_at_k(torch.tensor([n]), torch.tensor([c + 1]), k).item() >= value - 1e-14


@pytest.mark.parametrize(
    ("n", "c", "k", "field"),
    [
        ([4], [1], 0, "`k`"),
        ([4], [1], True, "`k`"),
        ([2, 4], [1, 1], 3, "`num_samples`"),
        ([4], [5], 1, "`num_correct`"),
        ([4], [-1], 1, "`num_correct`"),
        ([4.0], [1], 1, "`num_samples`"),
        ([4, 4], [1], 1, "`num_samples`"),
    ],
)
def test_pass_at_k_validation(n, c, k, field):
    with pytest.raises(ValueError, match=field):
        pass_at_k(torch.tensor(n), torch.tensor(c), k)


def test_uniform_average_equals_the_mean_exactly():
    g = torch.Generator().manual_seed(0)
    sds = [
        {
            "w": torch.randn(7, 5, generator=g),
            "h": torch.randn(9, generator=g).to(torch.bfloat16),
            "count": torch.tensor([3, 4]),
        }
        for _ in range(4)
    ]
    out = uniform_average(sds)
    for name in ("w", "h"):
        want = torch.stack([sd[name].double() for sd in sds]).mean(0).to(sds[0][name].dtype)
        assert out[name].dtype == sds[0][name].dtype and torch.equal(out[name], want), name
    assert torch.equal(out["count"], torch.tensor([3, 4]))
    assert torch.equal(uniform_average(sds[:1])["w"], sds[0]["w"])  # one checkpoint: itself


def test_uniform_average_validation():
    a = {"w": torch.zeros(2), "i": torch.tensor([1])}
    with pytest.raises(ValueError, match="empty"):
        uniform_average([])
    with pytest.raises(ValueError, match=r"state_dicts\[1\]"):
        uniform_average([a, {"w": torch.zeros(2)}])
    with pytest.raises(ValueError, match=r"state_dicts\[1\].*shape"):
        uniform_average([a, {"w": torch.zeros(3), "i": torch.tensor([1])}])
    with pytest.raises(ValueError, match="integer tensor 'i'"):
        uniform_average([a, {"w": torch.zeros(2), "i": torch.tensor([2])}])


def test_sampling_is_reproducible_and_leaves_the_rng_alone():
    from hf_stable.testing import build_tiny_model

    model, tokenizer = build_tiny_model(seed=0)
    prompts = ["12+3=", "7+8=", "40+2="]
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a = sample_completions(model, tokenizer, prompts, num_samples=4, max_new_tokens=4, seed=5, batch_size=2)
    assert torch.equal(torch.get_rng_state(), before)
    b = sample_completions(model, tokenizer, prompts, num_samples=4, max_new_tokens=4, seed=5, batch_size=2)
    c = sample_completions(model, tokenizer, prompts, num_samples=4, max_new_tokens=4, seed=6, batch_size=2)
    assert len(a) == 3 and all(len(group) == 4 for group in a)
    assert a == b and a != c
    greedy = sample_completions(model, tokenizer, prompts, num_samples=1, max_new_tokens=4, temperature=0)
    assert greedy == sample_completions(model, tokenizer, prompts, num_samples=1, max_new_tokens=4, temperature=0)
    with pytest.raises(ValueError, match="num_samples"):
        sample_completions(model, tokenizer, prompts, num_samples=2, max_new_tokens=4, temperature=0)


def first_char_scorer(completion, answer):
    """Correct when the first generated character is one of `answer`'s: pass@k strictly between 0 and 1."""
    return bool(completion) and completion[0] in answer


ROWS = [{"prompt": p, "answer": "0123456789"} for p in ("12+3=", "7+8=", "40+2=", "5+5=", "99+1=", "3+30=")]


def test_evaluate_pass_at_k_equals_independent_count():
    from hf_stable.testing import build_tiny_model

    model, tokenizer = build_tiny_model(seed=1)
    kw = dict(num_samples=6, max_new_tokens=3, seed=2)
    got = evaluate_pass_at_k(model, tokenizer, ROWS, ks=(1, 3), scorer=first_char_scorer, **kw)
    groups = sample_completions(model, tokenizer, [r["prompt"] for r in ROWS], **kw)
    counts = [sum(first_char_scorer(t, r["answer"]) for t in g) for g, r in zip(groups, ROWS, strict=True)]
    assert 0 < sum(counts) < 6 * len(ROWS)  # a non-trivial case
    for k in (1, 3):
        assert got[f"pass@{k}"] == pytest.approx(sum(exact_pass_at_k(6, c, k) for c in counts) / len(ROWS), abs=1e-12)
    assert got["num_problems"] == len(ROWS)
    with pytest.raises(ValueError, match="`ks`"):
        evaluate_pass_at_k(model, tokenizer, ROWS, ks=(7,), num_samples=6)
    with pytest.raises(ValueError, match="'answer' column"):
        evaluate_pass_at_k(model, tokenizer, [{"prompt": "1+1="}], num_samples=1)


# ---- hf-stable eval ------------------------------------------------------------------------------------------------

CLI_ROWS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)[-1]} for a in (3, 12, 40, 77) for b in (5, 9, 21)]


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory):
    """`checkpoint-{2,4,6}` of one tiny model with different weights, plus the weights of each."""
    from hf_stable.testing import build_tiny_model

    root = tmp_path_factory.mktemp("run")
    weights = {}
    for step, seed in ((2, 0), (4, 1), (6, 2)):
        model, tokenizer = build_tiny_model(seed=seed)
        folder = root / f"checkpoint-{step}"
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        weights[step] = {n: p.detach().clone() for n, p in model.named_parameters()}
    (root / "checkpoint-10-notes").mkdir()  # not a checkpoint folder
    data = root / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in CLI_ROWS))
    return root, weights, data


def _independent(root, params, *, ks, num_samples, seed):
    """pass@k of `params` loaded into the newest checkpoint's model, scored like `--match contains`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(root / "checkpoint-6")
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(params[n])
    tokenizer = AutoTokenizer.from_pretrained(root / "checkpoint-6")
    kw = dict(ks=ks, num_samples=num_samples, max_new_tokens=16, seed=seed)
    return evaluate_pass_at_k(model, tokenizer, CLI_ROWS, scorer=lambda t, a: a in t, **kw)


def test_cli_merges_the_last_checkpoints_and_scores_pass_at_k(run_folder, tmp_path, capsys):
    from hf_stable.cli.main import main

    root, weights, data = run_folder
    assert [p.rsplit("/", 1)[-1] for p in last_checkpoints(str(root), 2)] == ["checkpoint-4", "checkpoint-6"]
    out = tmp_path / "res" / "map.json"
    argv = ["eval", str(root), "--dataset", str(data), "--num_samples", "8", "--ks", "1,2", "--seed", "3"]
    argv += ["--match", "contains", "--output", str(out)]
    assert main([*argv, "--num_checkpoints", "2"]) == 0
    merged = json.loads(capsys.readouterr().out)
    assert merged == json.loads(out.read_text())
    assert merged["checkpoints"] == ["checkpoint-4", "checkpoint-6"] and merged["num_checkpoints"] == 2
    mean = {n: ((weights[4][n].double() + weights[6][n].double()) / 2).float() for n in weights[4]}
    want = _independent(root, mean, ks=(1, 2), num_samples=8, seed=3)
    assert {k: merged[k] for k in ("pass@1", "pass@2", "num_problems")} == want
    assert 0 < want["pass@1"] < 1  # a non-trivial case
    # --num_checkpoints 1 scores the newest checkpoint alone: another value, equal to its own independent score
    assert main([*argv, "--num_checkpoints", "1"]) == 0
    alone = json.loads(capsys.readouterr().out)
    assert alone["pass@1"] == _independent(root, weights[6], ks=(1,), num_samples=8, seed=3)["pass@1"]
    assert alone["pass@1"] != merged["pass@1"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--num_checkpoints", "4"], "`num_checkpoints`=4 but"),
        (["--ks", "1,9"], "`ks`"),
        (["--ks", "a"], "`--ks`"),
        (["--temperature", "0"], "`num_samples` must be 1"),
        (["--num_checkpoints", "0"], "`num_checkpoints`"),
        (["--max_new_tokens", "0"], "`--max_new_tokens`"),
    ],
)
def test_cli_expected_failures_are_one_line(run_folder, tmp_path, capsys, extra, message):
    from hf_stable.cli.main import main

    root, _, data = run_folder
    out = tmp_path / "map.json"
    argv = ["eval", str(root), "--dataset", str(data), "--num_samples", "4", "--output", str(out), *extra]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_cli_dataset_errors(run_folder, tmp_path, capsys):
    from hf_stable.cli.main import main

    root, _, good = run_folder
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "1+1="}) + "\n")
    assert main(["eval", str(root), "--dataset", str(bad)]) == 1
    assert "missing ['answer']" in capsys.readouterr().err
    assert main(["eval", str(tmp_path / "nowhere"), "--dataset", str(good)]) == 1
    assert "No such folder" in capsys.readouterr().err
