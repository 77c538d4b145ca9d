"""Model passes of the benchmark metrics against per-example float64 recomputation on the tiny model."""

import io
import math

import pytest
import torch

from hf_stable.evaluation.scoring import (
    answer_texts,
    encode_completion,
    encode_qa,
    generate_answers,
    gradient_norms,
    progress_bar,
    score_examples,
)
from hf_stable.testing import build_tiny_model


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_model(seed=3)


def test_encode_qa_plain_and_chat(tiny):
    _, tok = tiny
    plain = encode_qa(tok, "Who?", "Ann.", chat=False, fewshot=[("Q1?", "A1.")])
    answer = [t for t in plain["labels"] if t != -100]
    assert tok.decode(answer) == "Ann.<eos>"
    assert tok.decode(plain["prompt_ids"]) == "Question: Q1?\nAnswer: A1.\n\nQuestion: Who?\nAnswer: "
    assert plain["input_ids"][: len(plain["prompt_ids"])] == plain["prompt_ids"]
    chat = encode_qa(tok, "Who?", "Ann.", chat=True, system_prompt="Be brief.")
    assert tok.decode(chat["prompt_ids"]) == "<|system|>Be brief.<|user|>Who?<|assistant|>"
    assert tok.decode([t for t in chat["labels"] if t != -100]) == "Ann.<eos>"


def test_encode_completion_never_scores_the_first_token(tiny):
    _, tok = tiny
    example = encode_completion(tok, "Once", "upon a time", insert_space=True, max_length=5)
    assert tok.decode(example["input_ids"]) == "Once upon"  # 4 prefix characters + 5 text tokens
    assert example["labels"][:4] == [-100] * 4 and tok.decode(example["labels"][4:]) == " upon"
    bare = encode_completion(tok, "", "text")
    assert bare["labels"][0] == -100 and tok.decode(bare["labels"][1:]) == "ext"


def _reference(model, example, k=0.4):
    """float64, one unpadded example at a time, written from the metric definitions."""
    ids = torch.tensor([example["input_ids"]])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), -1)
    labels = example["labels"]
    positions = [t for t in range(1, len(labels)) if labels[t] != -100]
    token_logp = [float(logp[t - 1, labels[t]]) for t in positions]
    right = [int(logp[t - 1].argmax()) == labels[t] for t in positions]
    scored_logp, scored_right = token_logp[:-1], right[:-1]
    n = len(scored_right)
    k_star = next((j for j in range(n) if all(scored_right[j:])), n - 1) if n else 0
    keep = max(1, int(n * k)) if n else 0
    return {
        "avg_loss": -sum(token_logp) / len(token_logp),
        "exact_memorization": sum(scored_right) / n if n else math.nan,
        "extraction_strength": 1 - k_star / n if n else 0.0,
        "min_k": -sum(sorted(scored_logp)[:keep]) / keep if n else math.nan,
    }


def test_score_examples_matches_unpadded_float64(tiny):
    model, tok = tiny
    examples = [encode_qa(tok, f"Question {i}?" * (i + 1), "An answer " * i + "x.", chat=False) for i in range(5)]
    examples.append(encode_qa(tok, "Empty?", "", chat=False))  # EOS only: no token-wise position left
    got = score_examples(model, examples, pad=tok.pad_token_id, batch_size=4, progress=False)
    for i, example in enumerate(examples):
        ref = _reference(model, example)
        for key, value in ref.items():
            if math.isnan(value):
                assert math.isnan(got[key][i]), key
            else:
                assert float(got[key][i]) == pytest.approx(value, abs=2e-5), (i, key)


def test_gradient_norms_match_per_parameter_autograd(tiny):
    model, tok = tiny
    examples = [encode_qa(tok, "Who wrote it?", "Somebody did.", chat=False), encode_qa(tok, "Q?", "A.", chat=False)]
    got = gradient_norms(model, examples, pad=tok.pad_token_id, p=2, progress=False)
    params = list(model.parameters())
    for i, example in enumerate(examples):
        ids = torch.tensor([example["input_ids"]])
        labels = example["labels"]
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
        positions = [t for t in range(1, len(labels)) if labels[t] != -100][:-1]
        loss = -torch.stack([logp[t - 1, labels[t]] for t in positions]).mean()
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        expected = torch.stack([g.norm(2) for g in grads if g is not None]).mean()
        assert float(got[i]) == pytest.approx(float(expected), rel=1e-4)
    assert all(p.grad is None for p in params), "gradients must be cleared"
    with pytest.raises(ValueError, match="`p`=3 is not valid"):
        gradient_norms(model, examples, pad=tok.pad_token_id, p=3, progress=False)


def test_generate_answers_equals_a_manual_greedy_loop():
    model, tok = build_tiny_model(seed=3)
    with torch.no_grad():  # sharper logits, so greedy decoding writes varied characters instead of spaces
        for p in model.parameters():
            p.mul_(8)
    examples = [encode_qa(tok, q, "x", chat=False) for q in ("Hi?", "A longer question here?", "Mid?")]
    got = generate_answers(model, tok, examples, max_new_tokens=6, batch_size=2, progress=False)
    for example, text in zip(examples, got, strict=True):
        ids = list(example["prompt_ids"])
        new = []
        with torch.no_grad():
            for _ in range(6):
                token = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
                if token == tok.eos_token_id:
                    break
                ids.append(token)
                new.append(token)
        assert text == tok.decode(new, skip_special_tokens=True).strip()
    assert all(len(text) >= 4 for text in got), got
    stop = got[0][2:4]
    cut = generate_answers(model, tok, examples[:1], max_new_tokens=6, stopwords=["\n\n", stop], progress=False)
    assert cut == [got[0].split(stop)[0].strip()] and len(cut[0]) < len(got[0])


def test_answer_texts(tiny):
    _, tok = tiny
    assert answer_texts(tok, [encode_qa(tok, "Q?", "Forty two.", chat=False)]) == ["Forty two."]


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_bars_only_on_a_terminal_and_when_enabled():
    for stream, enabled, shown in (
        (io.StringIO(), True, False),
        (_Terminal(), False, False),
        (_Terminal(), True, True),
    ):
        assert list(progress_bar(range(3), desc="scoring forget", total=3, enabled=enabled, file=stream)) == [0, 1, 2]
        assert ("scoring forget" in stream.getvalue()) == shown
