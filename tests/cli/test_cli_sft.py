"""`hf-stable`: the console script, the YAML config path, the shipped accelerate configs."""

import json
import os
import subprocess
import sys

import pytest
from launch_helpers import run_with_stacks
from safetensors.torch import load_file

from hf_stable.cli.launch import ACCELERATE_CONFIGS, resolve_accelerate_config
from hf_stable.cli.main import main
from hf_stable.testing import arithmetic_dataset


CONFIG = """\
model_name_or_path: {model}
dataset_name: {data}
output_dir: {out}
sft_objective: prob_power
objective_alpha: 1.0
max_steps: 3
per_device_train_batch_size: 4
learning_rate: 0.01
max_length: 32
save_strategy: "no"
report_to: none
gradient_checkpointing: false
use_cpu: true
bf16: false
"""


def _console_script():
    return os.path.join(os.path.dirname(sys.executable), "hf-stable")


def _write_config(tmp_path, tiny_model_dir):
    data = tmp_path / "train.jsonl"
    with open(data, "w") as f:
        for row in arithmetic_dataset(16, seed=2):
            f.write(json.dumps(row) + "\n")
    config = tmp_path / "sft.yaml"
    out = tmp_path / "out"
    config.write_text(CONFIG.format(model=tiny_model_dir, data=data, out=out))
    return config, out


def _run(args):
    # a hang (the DDP run once hung at gloo teardown in CI) fails with every process's stack, the ranks included
    return run_with_stacks([_console_script(), *args])


@pytest.mark.slow
def test_sft_from_yaml_trains_and_writes_card(tmp_path, tiny_model_dir):
    config, out = _write_config(tmp_path, tiny_model_dir)
    _run(["sft", "--config", str(config)])
    trained = load_file(str(out / "model.safetensors"))
    initial = load_file(os.path.join(tiny_model_dir, "model.safetensors"))
    assert any((trained[k] != initial[k]).any() for k in initial), "the weights did not change"
    card = (out / "README.md").read_text()
    assert "hf_stable" in card and "StableSFTTrainer" in card and "prob_power(alpha=1)" in card


@pytest.mark.slow
@pytest.mark.distributed
def test_sft_with_shipped_ddp_config(tmp_path, tiny_model_dir):
    """`--accelerate_config ddp` resolves to the packaged YAML and runs two processes (gloo on a CPU box)."""
    config, out = _write_config(tmp_path, tiny_model_dir)
    result = _run(
        [
            "sft",
            "--config",
            str(config),
            "--accelerate_config",
            "ddp",
            "--main_process_port",
            "29642",
            "--ddp_find_unused_parameters",
            "false",
        ]
    )
    assert (out / "model.safetensors").is_file() and (out / "README.md").is_file()
    assert "Model and card saved" in result.stdout + result.stderr


def test_help_lists_hf_stable_flags(capsys):
    with pytest.raises(SystemExit) as done:
        main(["sft", "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert "--sft_objective" in text and "--synthetic_dataset" in text and "--learning_rate" in text


def test_bad_flag_fails_before_launch(tmp_path, tiny_model_dir, capsys, monkeypatch):
    config, _ = _write_config(tmp_path, tiny_model_dir)
    monkeypatch.delenv("HF_STABLE_DEBUG", raising=False)
    assert main(["sft", "--config", str(config), "--objective_alpha", "-2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hf-stable sft: error: `objective_alpha`") and "Traceback" not in err
    assert not (tmp_path / "out").exists()  # nothing was launched
    monkeypatch.setenv("HF_STABLE_DEBUG", "1")
    with pytest.raises(ValueError, match="objective_alpha"):
        main(["sft", "--config", str(config), "--objective_alpha", "-2"])


def test_list_command(capsys):
    assert main(["list", "--family", "sft_objective"]) == 0
    assert "prob_power" in capsys.readouterr().out


@pytest.mark.parametrize("name", ACCELERATE_CONFIGS)
def test_shipped_accelerate_configs_resolve(name):
    import yaml

    args = resolve_accelerate_config(["--num_processes", "2", "--accelerate_config", name])
    assert args[0] == "--config_file" and args[2:] == ["--num_processes", "2"]
    assert yaml.safe_load(open(args[1]))["distributed_type"] in ("MULTI_GPU", "DEEPSPEED", "FSDP")


def test_accelerate_config_errors(tmp_path):
    with pytest.raises(ValueError, match="ddp, zero2, zero3, fsdp2"):
        resolve_accelerate_config(["--accelerate_config", "zero4"])
    path = tmp_path / "mine.yaml"
    path.write_text("distributed_type: NO\n")
    assert resolve_accelerate_config(["--accelerate_config", str(path)]) == ["--config_file", str(path)]


GRPO_CONFIG = """\
model_name_or_path: {model}
synthetic_dataset: arithmetic
synthetic_train_size: 32
reward_funcs: [arithmetic_exact_match, tests_rewards.length_reward]
output_dir: {out}
advantage_estimator: sgrpo
sgrpo_noise_p: 0.1
loss_type: dr_grpo
num_generations: 4
per_device_train_batch_size: 8
max_completion_length: 4
max_steps: 2
learning_rate: 0.01
save_strategy: "no"
report_to: none
gradient_checkpointing: false
use_cpu: true
bf16: false
"""


@pytest.mark.slow
def test_grpo_from_yaml_with_named_and_dotted_rewards(tmp_path, tiny_model_dir):
    (tmp_path / "tests_rewards.py").write_text(
        "def length_reward(completions, **kwargs):\n    return [-0.1 * len(c) for c in completions]\n"
    )
    out = tmp_path / "out"
    config = tmp_path / "grpo.yaml"
    config.write_text(GRPO_CONFIG.format(model=tiny_model_dir, out=out))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [_console_script(), "grpo", "--config", str(config)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    card = (out / "README.md").read_text()
    assert "StableGRPOTrainer" in card and "sgrpo" in card and "2508.05928" in card


def test_unknown_reward_function_lists_the_valid_ones():
    from hf_stable.rewards.resolve import resolve_reward_function

    with pytest.raises(ValueError, match="arithmetic_exact_match"):
        resolve_reward_function("no_such_reward")
    assert resolve_reward_function("arithmetic_exact_match").__name__ == "arithmetic_reward"
    assert callable(resolve_reward_function("accuracy_reward"))  # TRL's own


@pytest.mark.slow
def test_sft_with_a_map_adapter_from_the_command_line(tmp_path, tiny_model_dir):
    """`--use_peft --lora_variant map` trains a MAP adapter that `load_adapter` restores."""
    from hf_stable.adapters import check_adapter

    config, out = _write_config(tmp_path, tiny_model_dir)
    _run(
        [
            "sft",
            "--config",
            str(config),
            "--use_peft",
            "--lora_variant",
            "map",
            "--lora_target_modules",
            "q_proj",
            "v_proj",
        ]
    )
    report = check_adapter(str(out))
    assert report["variants"] == ["map"] and report["hf_stable_version"]
    assert "lora_map_a" in " ".join(load_file(str(out / "adapter_model.safetensors")))


def test_bad_lora_variant_names_the_allowed_values():
    from hf_stable.scripts.model import StableModelConfig

    with pytest.raises(ValueError, match=r"lora_variant.*map, sine"):
        StableModelConfig(use_peft=True, lora_variant="dora")
    with pytest.raises(ValueError, match="use_peft"):
        StableModelConfig(lora_variant="map")


def test_stable_peft_config_keeps_trl_fields():
    from trl import get_peft_config

    from hf_stable.adapters import StableLoraConfig
    from hf_stable.scripts.model import StableModelConfig, get_stable_peft_config

    args = StableModelConfig(use_peft=True, lora_r=4, lora_alpha=16, lora_target_modules=["q_proj"])
    assert type(get_stable_peft_config(args)) is type(get_peft_config(args))  # no variant: TRL's own config
    args = StableModelConfig(
        use_peft=True, lora_r=4, lora_alpha=16, lora_target_modules=["q_proj"], lora_variant="sine", sine_freq=30.0
    )
    config = get_stable_peft_config(args)
    assert isinstance(config, StableLoraConfig) and config.use_sine and config.sine_freq == 30.0
    trl_config = get_peft_config(args)
    for name in ("r", "lora_alpha", "target_modules", "lora_dropout", "bias", "use_rslora", "task_type"):
        assert getattr(config, name) == getattr(trl_config, name), name


@pytest.mark.slow
def test_unlearn_from_the_command_line(tmp_path, tiny_model_dir):
    """`hf-stable unlearn` on forget/retain splits saved to disk: trains, evaluates, saves model, report and card."""
    from datasets import DatasetDict

    from hf_stable.testing import arithmetic_dataset

    rows = arithmetic_dataset(40, seed=5, max_operand=999).to_list()
    unique = list({r["prompt"]: r for r in rows}.values())
    from datasets import Dataset

    data = tmp_path / "data"
    DatasetDict({"forget": Dataset.from_list(unique[:8]), "retain": Dataset.from_list(unique[8:32])}).save_to_disk(
        str(data)
    )
    out = tmp_path / "out"
    _run(
        [
            "unlearn",
            "--model_name_or_path",
            tiny_model_dir,
            "--dataset_name",
            str(data),
            "--unlearn_method",
            "simnpo",
            "--max_steps",
            "3",
            "--per_device_train_batch_size",
            "4",
            "--output_dir",
            str(out),
            "--use_cpu",
            "--report_to",
            "none",
            "--save_strategy",
            "no",
        ]
    )
    report = json.loads((out / "unlearning_report.json").read_text())
    assert {"forget_acc", "forget_prob", "retain_acc"} <= set(report)
    assert (out / "model.safetensors").is_file()
    card = (out / "README.md").read_text()
    assert "UnlearningTrainer" in card and "simnpo" in card and "forget_prob" in card
    assert not any(r["prompt"] in card for r in unique[:8])
