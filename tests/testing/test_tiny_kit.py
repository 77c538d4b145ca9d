"""The offline tiny-model kit and synthetic tasks that every test, the demo and the experiments rely on."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_stable.testing import (
    arithmetic_dataset,
    arithmetic_preference_dataset,
    arithmetic_reward,
    build_tiny_model,
    build_tiny_tokenizer,
    evaluate_completions,
)


def test_tokenizer_is_character_level_and_lossless():
    tokenizer = build_tiny_tokenizer()
    text = "Hi there,\n12+34=46 (ok)"
    ids = tokenizer(text)["input_ids"]
    assert len(ids) == len(text)
    assert tokenizer.decode(ids) == text
    assert tokenizer.convert_tokens_to_ids(tokenizer.eos_token) == tokenizer.eos_token_id


def test_chat_template_marks_assistant_tokens():
    tokenizer = build_tiny_tokenizer()
    messages = [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"}]
    out = tokenizer.apply_chat_template(messages, return_assistant_tokens_mask=True, return_dict=True)
    kept = [t for t, m in zip(out["input_ids"], out["assistant_masks"], strict=True) if m]
    assert tokenizer.decode(kept) == "3" + tokenizer.eos_token
    prompt = tokenizer.apply_chat_template(messages[:1], add_generation_prompt=True, tokenize=False)
    assert tokenizer.apply_chat_template(messages, tokenize=False).startswith(prompt)


def test_model_saves_and_reloads_offline(tmp_path):
    model, _ = build_tiny_model(save_dir=tmp_path, seed=3)
    assert (tmp_path / "model.safetensors").is_file()
    assert not list(tmp_path.glob("*.bin"))  # safetensors only
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    ids = torch.tensor([tok("12+34=")["input_ids"]])
    torch.testing.assert_close(reloaded(ids).logits, model(ids).logits)
    assert type(reloaded).__name__ == "LlamaForCausalLM"


def test_seed_controls_weights_and_leaves_global_rng():
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    a, _ = build_tiny_model(seed=1)
    assert torch.equal(torch.rand(1), expected_next)
    b, _ = build_tiny_model(seed=1)
    c, _ = build_tiny_model(seed=2)
    first = next(a.parameters())
    assert torch.equal(first, next(b.parameters())) and not torch.equal(first, next(c.parameters()))


@pytest.mark.parametrize("ops", [("+",), ("+", "-", "*")])
def test_arithmetic_dataset_answers_are_correct(ops):
    data = arithmetic_dataset(200, seed=5, ops=ops, max_operand=50)
    assert data.column_names == ["prompt", "completion", "answer"]
    for row in data:
        expression = row["prompt"].rstrip("=")
        assert str(eval(expression)) == row["answer"] == row["completion"]
        assert int(row["answer"]) >= 0
    assert list(data) == list(arithmetic_dataset(200, seed=5, ops=ops, max_operand=50))
    assert list(data) != list(arithmetic_dataset(200, seed=6, ops=ops, max_operand=50))


def test_conversational_and_preference_forms():
    chat = arithmetic_dataset(3, conversational=True)
    assert chat[0]["prompt"][0]["role"] == "user" and chat[0]["completion"][0]["content"] == chat[0]["answer"]
    pairs = arithmetic_preference_dataset(100, seed=1)
    for row in pairs:
        assert row["chosen"] == row["answer"] != row["rejected"]
        assert len(row["rejected"]) == len(row["answer"]) and row["rejected"].isdigit()


def test_bad_task_arguments_raise():
    with pytest.raises(ValueError, match="ops"):
        arithmetic_dataset(3, ops=("/",))
    with pytest.raises(ValueError, match="max_operand"):
        arithmetic_dataset(3, max_operand=-1)


def test_reward_is_exact_match_for_both_forms():
    assert arithmetic_reward([" 46 ", "45", "046"], answer=["46", "46", "46"]) == [1.0, 0.0, 0.0]
    chat = [[{"role": "assistant", "content": "7"}], [{"role": "assistant", "content": "8"}]]
    assert arithmetic_reward(chat, answer=["7", "7"], prompts=["3+4=", "3+4="]) == [1.0, 0.0]
    with pytest.raises(TypeError):
        arithmetic_reward([42], answer=["42"])


def test_evaluate_completions_on_a_memorising_model():
    """A model that always answers "3": exact match on "1+2=" rows only, mean p from teacher forcing."""
    model, tokenizer = build_tiny_model(seed=0)
    eos = tokenizer.eos_token_id
    three = tokenizer.convert_tokens_to_ids("3")

    class Constant(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, input_ids, attention_mask=None):
            logits = torch.full((*input_ids.shape, len(tokenizer)), -30.0)
            after_eq = torch.zeros_like(input_ids, dtype=torch.bool)
            after_eq[:, :] = input_ids == tokenizer.convert_tokens_to_ids("=")
            logits[..., eos] = 0.0
            logits[after_eq] = -30.0
            logits[after_eq, three] = 0.0
            return type("Out", (), {"logits": logits})()

    from datasets import Dataset

    data = Dataset.from_list(
        [
            {"prompt": "1+2=", "completion": "3", "answer": "3"},
            {"prompt": "2+2=", "completion": "4", "answer": "4"},
        ]
    )
    wrapped = Constant()

    def generate(input_ids, attention_mask, max_new_tokens, **kw):
        return torch.cat([input_ids, torch.tensor([[three, eos]] * len(input_ids))], dim=1)

    wrapped.generate = generate
    scores = evaluate_completions(wrapped, tokenizer, data)
    assert scores["exact_match"] == 0.5 and scores["num_examples"] == 2
    # "3<eos>" has p = 1 * 1 on row one; row two's "4" gets p ≈ e^-30 and its eos p = 1
    assert scores["mean_p"] == pytest.approx(0.75, abs=1e-6)
