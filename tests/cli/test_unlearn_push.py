"""`hf-stable unlearn --push_to_hub` with adapters: the pushed folder holds the trained adapter and the merged model,
checked through an intercepted `HfApi` (nothing reaches the network)."""

import os
import shutil

import pytest
import torch
from huggingface_hub import HfApi
from safetensors.torch import load_file


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """Every upload is copied to ``tmp_path/pushed-<n>`` as `upload_folder` would send it."""
    uploads = []

    def create_repo(self, repo_id, **kwargs):
        return type("RepoUrl", (), {"repo_id": repo_id})()

    def upload_folder(self, *, folder_path, repo_id, ignore_patterns=(), **kwargs):
        target = tmp_path / f"pushed-{len(uploads)}"
        shutil.copytree(folder_path, target, ignore=shutil.ignore_patterns(*(ignore_patterns or ())))
        uploads.append((repo_id, target))
        return "commit"

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    return uploads


@pytest.mark.slow
def test_push_to_hub_with_adapters_pushes_the_trained_adapter_and_the_merged_model(tmp_path, tiny_model_dir, hub):
    from datasets import Dataset, DatasetDict
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hf_stable import UnlearningConfig
    from hf_stable.scripts.model import StableModelConfig
    from hf_stable.scripts.unlearn import UnlearnScriptArguments, main
    from hf_stable.testing import arithmetic_dataset

    rows = list({r["prompt"]: r for r in arithmetic_dataset(60, seed=5, max_operand=999).to_list()}.values())
    data = tmp_path / "data"
    DatasetDict({"forget": Dataset.from_list(rows[:8]), "retain": Dataset.from_list(rows[8:32])}).save_to_disk(
        str(data)
    )
    out = tmp_path / "out"
    args = UnlearningConfig(
        output_dir=str(out),
        unlearn_method="graddiff",
        learning_rate=5e-2,
        max_steps=3,
        per_device_train_batch_size=4,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        push_to_hub=True,
        hub_model_id="me/unlearned",
    )
    model_args = StableModelConfig(
        model_name_or_path=tiny_model_dir, use_peft=True, lora_r=4, lora_target_modules=["q_proj", "v_proj"]
    )
    main(UnlearnScriptArguments(dataset_name=str(data)), args, model_args)

    repo, pushed = hub[-1]  # what the Hub holds in the end
    adapter = load_file(pushed / "adapter_model.safetensors")
    assert adapter and any("lora_B" in name and t.abs().max() > 0 for name, t in adapter.items())  # trained
    ids = torch.tensor([[1, 5, 7, 9, 11, 13]])
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    with torch.no_grad():
        start = base(input_ids=ids).logits
        adapted = PeftModel.from_pretrained(base, str(pushed)).eval()(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(pushed / "merged").eval()(input_ids=ids).logits
    assert not torch.allclose(adapted, start, atol=1e-4)  # the pushed adapter moved the model
    assert torch.allclose(merged, adapted, atol=1e-5)  # and the merged export is the same model
    card = (pushed / "README.md").read_text()
    assert "forget_prob" in card and "graddiff" in card  # the card with the evaluation, not a bare one
    assert str(tmp_path) not in card and not any(r["prompt"] in card for r in rows[:8])
    assert os.path.isfile(out / "unlearning_report.json")
    assert len(hub) == 1 and repo == "me/unlearned"  # one upload, with everything (no bare intermediate commit)
