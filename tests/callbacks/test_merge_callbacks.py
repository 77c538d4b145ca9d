"""MergeOnTrainEndCallback (in memory and through the engine) and PushMergedToHubCallback on a tiny training run;
the Hub is intercepted at `HfApi` (no network)."""

import os

import pytest
import torch
from huggingface_hub import HfApi, ModelCard
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, TrainerCallback
from wsm_helpers import make_trainer, tiny_model

from hf_stable.callbacks import MergeOnTrainEndCallback, PushMergedToHubCallback, WSMCallback


def weights(folder):
    return load_file(os.path.join(folder, "model.safetensors"))


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    """Two same-architecture models with different weights (perturbed copies of the tiny model)."""
    root = tmp_path_factory.mktemp("pool")
    paths = []
    for seed in (1, 2):
        model, tokenizer = tiny_model()
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g))
        path = str(root / f"m{seed}")
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        paths.append(path)
    return paths


class FinalWeights(TrainerCallback):
    """Independent record of the trained weights (runs before the merge callback at train end)."""

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self.state = {n: t.detach().clone().double() for n, t in model.state_dict().items()}

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.initial = {n: t.detach().clone().double() for n, t in model.state_dict().items()}


@pytest.mark.parametrize("mode", ["memory", "engine"])
def test_linear_with_pool(tmp_path, pool, mode):
    final = FinalWeights()
    cb = MergeOnTrainEndCallback(method="linear", pool=pool, weights=[2.0, 1.0, 1.0], mode=mode)
    make_trainer(tmp_path, [final, cb], max_steps=3).train()
    out = tmp_path / "merged"
    assert cb.output_dir == str(out)
    got = weights(out)
    p1, p2 = weights(pool[0]), weights(pool[1])
    for name, t in got.items():
        want = (2 * final.state[name] + p1[name].double() + p2[name].double()) / 4
        torch.testing.assert_close(t.double(), want, atol=1e-6, rtol=0, msg=name)
    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert model.config.hidden_size == 16
    assert not (tmp_path / "merge-final-weights").exists()
    # the card of `hf-stable merge`, with local parents named by folder only
    card = ModelCard.load(out / "README.md")
    assert card.data.tags == ["hf_stable", "merge", "linear"] and card.data.base_model_relation == "merge"
    assert card.data.base_model is None  # Hub ids only; every parent here is a local folder
    text = (out / "README.md").read_text()
    assert str(tmp_path) not in text and os.path.dirname(pool[0]) not in text


def test_task_arithmetic_from_initial(tmp_path, pool):
    final = FinalWeights()
    cb = MergeOnTrainEndCallback(method="task_arithmetic", base="initial", pool=pool[:1], params={"lambda": 0.5})
    make_trainer(tmp_path, [final, cb], max_steps=3).train()
    assert (tmp_path / "merge-initial" / "model.safetensors").exists()
    got, p1 = weights(tmp_path / "merged"), weights(pool[0])
    for name, t in got.items():
        b = final.initial[name]
        want = b + 0.5 * ((final.state[name] - b) + (p1[name].double() - b))
        torch.testing.assert_close(t.double(), want, atol=1e-6, rtol=0, msg=name)


def test_merge_validation(tmp_path, pool):
    with pytest.raises(ValueError, match="pool"):
        MergeOnTrainEndCallback(method="linear")
    with pytest.raises(ValueError, match="weights"):
        MergeOnTrainEndCallback(pool=pool, weights=[1.0])
    with pytest.raises(ValueError, match="not a folder"):
        MergeOnTrainEndCallback(pool=[str(tmp_path / "nope")])
    with pytest.raises(ValueError, match="mode"):
        MergeOnTrainEndCallback(pool=pool, mode="gpu")


class RecordingApi(HfApi):
    def __init__(self):
        super().__init__(token=None)
        self.calls = []

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", repo_id, kwargs.get("private")))
        return type("Url", (), {"repo_id": repo_id})()

    def upload_folder(self, *, repo_id, folder_path, allow_patterns=None, **kwargs):
        self.calls.append(("upload_folder", repo_id, sorted(allow_patterns or [])))
        return "commit"


def test_push_merged_folder(tmp_path, pool):
    api = RecordingApi()
    merge = MergeOnTrainEndCallback(method="linear", pool=pool[:1])
    push = PushMergedToHubCallback("me/merged-tiny", subdir="merged", private=True, api=api)
    make_trainer(tmp_path, [merge, push], max_steps=2).train()
    assert push.result == "commit"
    assert api.calls[0] == ("create_repo", "me/merged-tiny", True)
    kind, repo, files = api.calls[1]
    assert (kind, repo) == ("upload_folder", "me/merged-tiny")
    assert {"config.json", "model.safetensors", "README.md"} <= set(files)
    assert set(files) == set(os.listdir(tmp_path / "merged")) - {"training_args.bin"}


def test_wsm_push_to_hub_via_hfapi(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(
        HfApi, "create_repo", lambda self, repo_id, **kw: calls.append(("create", repo_id)) or type("U", (), {})()
    )
    monkeypatch.setattr(HfApi, "upload_folder", lambda self, **kw: calls.append(("upload", kw["folder_path"])))
    cb = WSMCallback(interval_steps=1, num_intervals=2, push_to_hub=True, hub_repo_id="me/wsm")
    make_trainer(tmp_path, [cb], max_steps=4).train()
    assert calls == [("create", "me/wsm"), ("upload", str(tmp_path / "wsm-merged"))]


def test_distributed_helpers_single_process():
    from hf_stable import distributed as dist

    model, _ = tiny_model()

    class Wrapper(torch.nn.Module):  # DDP-like: the model under `.module`
        def __init__(self, module):
            super().__init__()
            self.module = module

    assert dist.is_main_process() and dist.num_processes() == 1
    dist.barrier()  # no-op without a process group
    assert dist.unwrap_model(Wrapper(Wrapper(model))) is model
    full = dist.gather_full_state_dict(Wrapper(model))
    assert full.keys() == model.state_dict().keys()
    for name, t in model.state_dict().items():
        assert full[name].device.type == "cpu" and torch.equal(full[name], t)
    p = next(model.parameters())
    assert dist.local_shard(p) is p and not dist.is_fsdp2(model) and not dist.is_zero3_partitioned(model)
    assert dist.broadcast_object({"a": 1}) == {"a": 1}
