"""Saving and loading MAP and sine adapters: `load_adapter`, stock PEFT after `import hf_stable`, and without it.

The fresh-process checks run in subprocesses, so that nothing registered by this test process (custom modules, the
`peft.config` hook) can make a load look right.
"""

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from peft import get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from hf_stable._peft_hook import SAVED_PEFT_TYPE
from hf_stable.adapters import StableLoraConfig, check_adapter, load_adapter


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def train_and_save(base_dir, out_dir, ascent=False, **variant):
    """A few Adam steps on a random objective (so every adapter parameter moves), then `save_pretrained`. Returns the
    eval logits on fixed inputs."""
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    config = StableLoraConfig(r=4, target_modules="all-linear", lora_dropout=0.0, **variant)
    model = get_peft_model(model, config)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(7, model.config.vocab_size, (2, 12), generator=g)
    labels = torch.randint(7, model.config.vocab_size, (2, 12), generator=g)
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    for _ in range(20):
        loss = model(input_ids=ids, labels=labels).loss
        (-loss if ascent else loss).backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    model.save_pretrained(out_dir)
    return ids, logits


@pytest.fixture(scope="module")
def saved(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    map_dir, sine_dir = str(root / "map"), str(root / "sine")
    ids, map_logits = train_and_save(tiny_model_dir, map_dir, use_map=True)
    _, sine_logits = train_and_save(tiny_model_dir, sine_dir, ascent=True, use_sine=True, sine_freq=50.0)
    save_file({"ids": ids, "map": map_logits, "sine": sine_logits}, str(root / "expected.safetensors"))
    return {
        "root": root,
        "base": tiny_model_dir,
        "map": map_dir,
        "sine": sine_dir,
        "ids": ids,
        "logits": {"map": map_logits, "sine": sine_logits},
    }


# Runs in a fresh interpreter: argv = base dir, map dir, sine dir, expected file, output dir.
WITH_HF_STABLE = textwrap.dedent(
    """
    import json, sys
    import hf_stable  # first: the hook must catch `peft.config` being imported
    import torch
    from peft import AutoPeftModelForCausalLM, PeftModel, get_peft_model_state_dict
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM
    from hf_stable.adapters import load_adapter

    torch.set_num_threads(1)
    base, map_dir, sine_dir, expected, out = sys.argv[1:]
    ids = load_file(expected)["ids"]
    logits, meta = {}, {}

    def record(name, model, path):
        model.eval()
        with torch.no_grad():
            logits[name] = model(input_ids=ids).logits
        layer = model.base_model.model.model.layers[0].mlp.down_proj
        saved = load_file(path + "/adapter_model.safetensors")
        state = get_peft_model_state_dict(model)
        meta[name] = {
            "layer": type(layer).__name__,
            "variant": type(layer.lora_variant.get("default")).__name__,
            "config": type(model.peft_config["default"]).__name__,
            "same_keys": sorted(saved) == sorted(state),
            "same_tensors": all(torch.equal(saved[k], state[k]) for k in saved),
        }

    record("load_adapter_map", load_adapter(AutoModelForCausalLM.from_pretrained(base), map_dir), map_dir)
    record("peft_map", PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), map_dir), map_dir)
    record("auto_map", AutoPeftModelForCausalLM.from_pretrained(map_dir), map_dir)
    record("load_adapter_sine", load_adapter(AutoModelForCausalLM.from_pretrained(base), sine_dir), sine_dir)
    record("peft_sine", PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), sine_dir), sine_dir)
    record("auto_sine", AutoPeftModelForCausalLM.from_pretrained(sine_dir), sine_dir)
    for variant, path in (("map", map_dir), ("sine", sine_dir)):  # transformers' own adapter loading
        model = AutoModelForCausalLM.from_pretrained(base)
        model.load_adapter(path)
        with torch.no_grad():
            logits[f"transformers_{variant}"] = model.eval()(input_ids=ids).logits
    save_file(logits, out + "/logits.safetensors")
    json.dump(meta, open(out + "/meta.json", "w"))
    """
)

WITHOUT_HF_STABLE = textwrap.dedent(
    """
    import json, sys, warnings
    import torch
    from peft import AutoPeftModelForCausalLM, PeftConfig, PeftModel
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    base, map_dir, sine_dir, expected, out = sys.argv[1:]
    ids = load_file(expected)["ids"]
    logits, meta = {}, {"hf_stable_imported": "hf_stable" in sys.modules}
    loaders = {
        "peft": lambda path: PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), path),
        "auto": lambda path: AutoPeftModelForCausalLM.from_pretrained(path),
        "config": lambda path: PeftConfig.from_pretrained(path),
        "transformers": lambda path: AutoModelForCausalLM.from_pretrained(base).load_adapter(path),
    }
    for variant, path in (("map", map_dir), ("sine", sine_dir)):
        for how, load in loaders.items():
            try:
                load(path)
            except Exception as error:
                meta[f"{how}_{variant}"] = [type(error).__name__, str(error)]
            else:
                meta[f"{how}_{variant}"] = None

    import hf_stable  # late: peft is loaded already, so the hook wraps it directly

    for variant, path in (("map", map_dir), ("sine", sine_dir)):
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), path).eval()
        with torch.no_grad():
            logits[f"late_{variant}"] = model(input_ids=ids).logits
        layer = model.base_model.model.model.layers[0].mlp.down_proj
        meta[f"late_{variant}"] = {"layer": type(layer).__name__, "variants": sorted(layer.lora_variant)}
    save_file(logits, out + "/logits.safetensors")
    json.dump(meta, open(out + "/meta.json", "w"))
    """
)


def run_fresh(script, args, out):
    os.makedirs(out, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, "-c", script, *args, out], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(os.path.join(out, "meta.json"), encoding="utf-8") as f:
        return load_file(os.path.join(out, "logits.safetensors")), json.load(f)


@pytest.fixture(scope="module")
def fresh_with_hf_stable(saved):
    args = [saved["base"], saved["map"], saved["sine"], str(saved["root"] / "expected.safetensors")]
    return run_fresh(WITH_HF_STABLE, args, str(saved["root"] / "with"))


@pytest.fixture(scope="module")
def fresh_without_hf_stable(saved):
    args = [saved["base"], saved["map"], saved["sine"], str(saved["root"] / "expected.safetensors")]
    return run_fresh(WITHOUT_HF_STABLE, args, str(saved["root"] / "without"))


def test_saved_files_mark_the_variant(saved):
    from hf_stable import __version__

    for variant, path in (("map", saved["map"]), ("sine", saved["sine"])):
        with open(os.path.join(path, "adapter_config.json"), encoding="utf-8") as f:
            config = json.load(f)
        assert config[f"use_{variant}"] is True and config["hf_stable_version"] == __version__
        assert config["base_model_name_or_path"] == saved["base"]
        assert check_adapter(path) == {
            "variants": [variant],
            "needs_hf_stable": True,
            "hf_stable_version": __version__,
            "peft_type": SAVED_PEFT_TYPE,
        }
        assert config["peft_type"] == SAVED_PEFT_TYPE
    keys = load_file(os.path.join(saved["map"], "adapter_model.safetensors"))
    assert sum(k.endswith(("lora_map_a", "lora_map_b")) for k in keys) == 2 * 14


@pytest.mark.parametrize("variant", ["map", "sine"])
def test_load_adapter_in_process(saved, variant):
    model = load_adapter(AutoModelForCausalLM.from_pretrained(saved["base"]), saved[variant])
    assert not any(p.requires_grad for p in model.parameters())
    with torch.no_grad():
        logits = model(input_ids=saved["ids"]).logits
    assert torch.equal(logits, saved["logits"][variant])


def test_load_adapter_trainable_under_another_name(saved):
    model = load_adapter(
        AutoModelForCausalLM.from_pretrained(saved["base"]), saved["map"], adapter_name="mine", is_trainable=True
    )
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert {re.search(r"\.(lora_[^.]+)\.mine(\.weight)?$", n).group(1) for n in trainable} == {
        "lora_A",
        "lora_B",
        "lora_map_a",
        "lora_map_b",
    }
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(input_ids=saved["ids"]).logits, saved["logits"]["map"])


@pytest.mark.parametrize(
    ("name", "variant"),
    [
        ("load_adapter_map", "map"),
        ("peft_map", "map"),
        ("auto_map", "map"),
        ("load_adapter_sine", "sine"),
        ("peft_sine", "sine"),
        ("auto_sine", "sine"),
    ],
)
def test_fresh_process_with_hf_stable_reproduces_logits_exactly(saved, fresh_with_hf_stable, name, variant):
    logits, meta = fresh_with_hf_stable
    assert torch.equal(logits[name], saved["logits"][variant])
    assert meta[name] == {
        "layer": "StableLinear",
        "variant": {"map": "MapLinearVariant", "sine": "SineLinearVariant"}[variant],
        "config": "StableLoraConfig",
        "same_keys": True,
        "same_tensors": True,
    }


@pytest.mark.parametrize("variant", ["map", "sine"])
def test_fresh_process_with_hf_stable_transformers_load_adapter(saved, fresh_with_hf_stable, variant):
    """`transformers`' own `model.load_adapter` restores the variant too. For MAP only to fp32 round-off (1.8e-7 on
    the logits): every tensor and ‖W0‖ load bit-equal, the difference is in how the loaded layers compute."""
    logits, _ = fresh_with_hf_stable
    torch.testing.assert_close(logits[f"transformers_{variant}"], saved["logits"][variant], rtol=0, atol=1e-6)
    assert (
        logits[f"transformers_{variant}"] - saved["logits"]["map" if variant == "sine" else "sine"]
    ).abs().max() > 1e-3


@pytest.mark.parametrize("variant", ["map", "sine"])
@pytest.mark.parametrize("how", ["peft", "auto", "config", "transformers"])
def test_fresh_process_without_hf_stable_refuses_loudly(saved, fresh_without_hf_stable, how, variant):
    """Stock PEFT (no `import hf_stable`) must not build plain LoRA from a MAP/sine folder: every loader raises,
    and the message names hf_stable. (With a `peft_type` of "LORA" it loaded plain LoRA, logits off by 0.49.)"""
    _, meta = fresh_without_hf_stable
    assert meta["hf_stable_imported"] is False
    assert meta[f"{how}_{variant}"] is not None, f"stock PEFT loaded a {variant} adapter through {how}"
    kind, message = meta[f"{how}_{variant}"]
    assert kind == "KeyError" and SAVED_PEFT_TYPE in message and "import hf_stable" in message


@pytest.mark.parametrize("variant", ["map", "sine"])
def test_importing_hf_stable_after_peft_loads_exactly(saved, fresh_without_hf_stable, variant):
    logits, meta = fresh_without_hf_stable
    assert meta[f"late_{variant}"] == {"layer": "StableLinear", "variants": ["default"]}
    assert torch.equal(logits[f"late_{variant}"], saved["logits"][variant])


def test_adapter_saved_with_peft_type_lora_still_loads(saved, tmp_path):
    """Folders written before the `peft_type` marker (`"LORA"` plus `use_map`) load exactly through hf_stable."""
    import shutil

    old = tmp_path / "old"
    shutil.copytree(saved["map"], old)
    config_file = old / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config["peft_type"] = "LORA"
    config_file.write_text(json.dumps(config))
    assert check_adapter(str(old))["needs_hf_stable"] is True
    model = load_adapter(AutoModelForCausalLM.from_pretrained(saved["base"]), str(old))
    with torch.no_grad():
        assert torch.equal(model(input_ids=saved["ids"]).logits, saved["logits"]["map"])


# Runs in a fresh interpreter with one PEFT internal the hook needs removed, as a PEFT refactor would.
# argv = order ("peft_first": peft is loaded before hf_stable; "hf_stable_first": the internal disappears while
# `peft.config` is being imported under the hook), the attribute, base dir, map dir, expected file, output dir.
HOOK_BROKEN = textwrap.dedent(
    """
    import importlib.abc, importlib.util, json, sys, warnings
    import torch

    order, attribute, base, map_dir, expected, out = sys.argv[1:]
    torch.set_num_threads(1)
    warnings.simplefilter("always")
    caught = warnings.catch_warnings(record=True)
    records = caught.__enter__()

    class MovedInternal(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, fullname, path, target=None):
            if fullname != "peft.config":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(fullname)
            self.loader = spec.loader
            spec.loader = self
            return spec

        def create_module(self, spec):
            return self.loader.create_module(spec)

        def exec_module(self, module):
            self.loader.exec_module(module)
            delattr(module.PeftConfigMixin, attribute)

    if order == "peft_first":
        import peft.config
        delattr(peft.config.PeftConfigMixin, attribute)
        import hf_stable
    else:
        import hf_stable
        sys.meta_path.insert(1, MovedInternal())  # right after hf_stable's finder, which delegates to it
    import peft
    from peft import PeftModel
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM
    from hf_stable.adapters import load_adapter

    meta = {"removed": not hasattr(peft.config.PeftConfigMixin, attribute)}
    try:
        PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), map_dir)
    except Exception as error:
        meta["peft_load"] = type(error).__name__
    else:
        meta["peft_load"] = None
    model = load_adapter(AutoModelForCausalLM.from_pretrained(base), map_dir).eval()
    with torch.no_grad():
        logits = {"load_adapter": model(input_ids=load_file(expected)["ids"]).logits}
    meta["warnings"] = [str(w.message) for w in records if "hf_stable could not hook" in str(w.message)]
    save_file(logits, out + "/logits.safetensors")
    json.dump(meta, open(out + "/meta.json", "w"))
    """
)


@pytest.mark.parametrize(
    ("order", "attribute"), [("peft_first", "from_peft_type"), ("hf_stable_first", "_get_peft_type")]
)
def test_hook_fails_soft_when_peft_internals_move(saved, order, attribute):
    """`import peft` keeps working, one warning names the lost feature, PEFT's loaders refuse the MAP folder
    loudly, and `load_adapter` still reproduces the trained logits."""
    args = [order, attribute, saved["base"], saved["map"], str(saved["root"] / "expected.safetensors")]
    logits, meta = run_fresh(HOOK_BROKEN, args, str(saved["root"] / f"broken-{order}-{attribute}"))
    assert meta["removed"] is True
    assert len(meta["warnings"]) == 1, meta["warnings"]
    assert (
        attribute in meta["warnings"][0]
        and "loading MAP/sine adapters through PEFT's own loaders" in (meta["warnings"][0])
    )
    assert meta["peft_load"] in ("KeyError", "AttributeError")  # AttributeError: stock PEFT needs it as well
    assert torch.equal(logits["load_adapter"], saved["logits"]["map"])
