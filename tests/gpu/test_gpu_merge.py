"""Merging on CUDA: the in-memory merge (`merge_state_dicts`, which MergeOnTrainEndCallback's memory mode uses) run on
CUDA tensors equals the streaming engine (which reads and computes on the CPU; it has no device option) on checkpoints
of a CUDA run, and MergeOnTrainEndCallback merges a model trained on CUDA."""

import pytest
import torch
from gpu_helpers import GPU, ON_GPU


pytestmark = GPU


@pytest.fixture
def cuda_checkpoints(tmp_path):
    from wsm_helpers import make_trainer, tiny_model

    folders = []
    for seed in (0, 1):
        model, _ = tiny_model()
        trainer = make_trainer(tmp_path / f"run{seed}", [], max_steps=3, model=model, seed=seed, **ON_GPU)
        trainer.train()
        assert next(trainer.model.parameters()).device.type == "cuda"
        trainer.save_model(str(tmp_path / f"ckpt{seed}"))
        folders.append(str(tmp_path / f"ckpt{seed}"))
    return folders


@pytest.mark.parametrize("method", ["linear", "ties", "fisher_rao"])
def test_engine_on_cuda_checkpoints_matches_reference(cuda_checkpoints, tmp_path, method):
    from safetensors.torch import load_file

    from hf_stable.merging import merge
    from hf_stable.merging.reference import merge_state_dicts

    recipe = {
        "merge_method": method,
        "models": [{"model": f, "parameters": {"weight": 0.5}} for f in cuda_checkpoints],
    }
    if method == "ties":
        recipe["base_model"] = cuda_checkpoints[0]
        recipe["models"] = [{"model": cuda_checkpoints[1], "parameters": {"weight": 1.0, "density": 0.5}}]
    result = merge({**recipe, "out_dtype": "float32"}, tmp_path / "merged", progress=False)
    got = load_file(str(result.output_dir / "model.safetensors"))
    inputs = [
        load_file(str(__import__("pathlib").Path(m["model"]) / "model.safetensors"), device="cuda")
        for m in recipe["models"]
    ]
    base = (
        load_file(str(__import__("pathlib").Path(recipe["base_model"]) / "model.safetensors"), device="cuda")
        if "base_model" in recipe
        else None
    )
    want = merge_state_dicts(
        method,
        inputs,
        base=base,
        weights=[m["parameters"]["weight"] for m in recipe["models"]],
        params={k: v for m in recipe["models"][:1] for k, v in m["parameters"].items() if k != "weight"},
    )
    for name, tensor in want.items():
        assert tensor.device.type == "cuda"
        torch.testing.assert_close(got[name], tensor.cpu().to(got[name].dtype), atol=1e-5, rtol=1e-4, msg=name)


def test_merge_on_train_end_with_a_cuda_model(cuda_checkpoints, tmp_path):
    from safetensors.torch import load_file
    from wsm_helpers import make_trainer

    from hf_stable.callbacks import MergeOnTrainEndCallback

    cb = MergeOnTrainEndCallback(method="linear", pool=cuda_checkpoints[:1])
    trainer = make_trainer(tmp_path / "run", [cb], max_steps=2, **ON_GPU)
    trainer.train()
    merged = load_file(str(tmp_path / "run" / "merged" / "model.safetensors"))
    pool = load_file(str(__import__("pathlib").Path(cuda_checkpoints[0]) / "model.safetensors"))
    final = {n: p.detach().cpu() for n, p in trainer.model.named_parameters()}
    for name, tensor in merged.items():
        if name in final:
            torch.testing.assert_close(tensor, 0.5 * (final[name] + pool[name]), atol=1e-6, rtol=0, msg=name)
