"""Contract test: every private TRL / transformers / accelerate hook hf_stable relies on, exercised for real.

TRL and transformers rename private methods between releases (`_get_per_token_logps` became
`_get_per_token_logps_and_entropies`). When an upgrade breaks one of these, the failure names the hook instead of
surfacing as a wrong loss somewhere downstream. One test per hook; a hook used by a later family is added here with it.
"""

import inspect

import pytest
import torch
from sft_helpers import STEP_ARGS
from transformers import Trainer
from trl import SFTTrainer

from hf_stable import StableSFTConfig, StableSFTTrainer
from hf_stable.testing import arithmetic_dataset, build_tiny_model


def _params(fn):
    return list(inspect.signature(fn).parameters)


def _contract(hook: str, ok: bool, detail: str = ""):
    assert ok, f"The private hook `{hook}` hf_stable relies on has changed. {detail}"


class _Recorder(StableSFTTrainer):
    """Records what the loop hands to the hooks (a subclass, not a mock: the real loop runs)."""

    events: list

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        self.events.append(("batches", len(batches), num_items))
        return batches, num_items

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.events.append(("step", self.accelerator.sync_gradients, self.current_gradient_accumulation_steps))
        return super().training_step(model, inputs, num_items_in_batch)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    model, tokenizer = build_tiny_model(seed=0)
    args = StableSFTConfig(
        output_dir=str(tmp_path_factory.mktemp("contract")),
        **{**STEP_ARGS, "max_steps": 2, "save_strategy": "steps", "save_steps": 1},
        per_device_train_batch_size=2,
        gradient_accumulation_steps=3,
        sft_objective="prob_power",
    )
    trainer = _Recorder(model=model, args=args, train_dataset=arithmetic_dataset(12), processing_class=tokenizer)
    trainer.events = []
    trainer.train()
    return trainer


def test_fused_lm_head_outputs(trained):
    """`trl.trainer.utils.add_fused_lm_head`: `model(..., fused_lm_head=True)` returns per-target log-probs etc."""
    batch = trained._prepare_inputs(trained.data_collator([trained.train_dataset[i] for i in range(3)]))
    with trained.fused_forward():  # StableSFTTrainer hands back the model's own forward after training
        out = trained.model(**batch, fused_lm_head=True)
    for field in ("log_probs", "entropy", "is_top1", "label_mask"):
        _contract("FusedCausalLMOutput", getattr(out, field, None) is not None, f"missing field {field!r}")
    targets = batch["labels"][:, 1:] != -100
    _contract(
        "FusedCausalLMOutput.label_mask",
        torch.equal(out.label_mask.bool(), targets),
        "label_mask must mark the shifted labels that are not -100",
    )
    _contract(
        "FusedCausalLMOutput.log_probs",
        bool((out.log_probs[~targets] == 0).all()),
        "log_probs must be zero at ignored positions",
    )


def test_get_batch_samples_sees_the_whole_step(trained):
    """`Trainer.get_batch_samples(epoch_iterator, num_batches, device)` returns every micro-batch of an optimizer step
    before the first forward: hf_stable's step-wide denominators are computed there."""
    _contract(
        "Trainer.get_batch_samples",
        _params(Trainer.get_batch_samples)[1:] == ["epoch_iterator", "num_batches", "device"],
    )
    batches = [e for e in trained.events if e[0] == "batches"]
    _contract("Trainer.get_batch_samples", [b[1] for b in batches] == [3, 3], f"got {batches}")


def test_sync_gradients_marks_last_micro_batch(trained):
    """`accelerator.sync_gradients` is True exactly on the last micro-batch of each step (end-of-step rescale and
    dual updates run there), and `current_gradient_accumulation_steps` holds the step's micro-batch count."""
    steps = [e for e in trained.events if e[0] == "step"]
    _contract("Accelerator.sync_gradients", [s[1] for s in steps] == [False, False, True] * 2, f"got {steps}")
    _contract("Trainer.current_gradient_accumulation_steps", all(s[2] == 3 for s in steps), f"got {steps}")


def test_loss_is_scaled_for_ga_is_honoured():
    """`Trainer.loss_is_scaled_for_ga` (transformers >= 5.19): True means the loss is used as returned."""
    _contract("Trainer.loss_is_scaled_for_ga", hasattr(Trainer, "loss_is_scaled_for_ga"))
    source = inspect.getsource(Trainer.training_step)
    _contract(
        "Trainer.training_step",
        "self.loss_is_scaled_for_ga" in source,
        "training_step no longer reads loss_is_scaled_for_ga",
    )


def test_trainer_method_signatures():
    expected = {
        "training_step": ["model", "inputs", "num_items_in_batch"],
        "compute_loss": ["model", "inputs", "return_outputs", "num_items_in_batch"],
        "_save_checkpoint": ["model", "trial"],
        "_get_train_sampler": ["train_dataset"],
        "_prepare_inputs": ["inputs"],
        "_get_output_dir": ["trial"],
        "train": ["resume_from_checkpoint", "trial", "ignore_keys_for_eval"],
    }
    for name, params in expected.items():
        got = _params(getattr(Trainer, name))[1:]
        _contract(f"Trainer.{name}", got[: len(params)] == params, f"signature is now {got}")
    for name in ("get_tp_size", "get_cp_size", "get_sp_size"):
        _contract(f"Trainer.{name}", callable(getattr(Trainer, name, None)))


def test_sft_trainer_internals(trained):
    got = _params(SFTTrainer._prepare_dataset)[1:]
    _contract(
        "SFTTrainer._prepare_dataset",
        got == ["dataset", "processing_class", "args", "packing", "formatting_func", "dataset_name"],
        f"signature is now {got}",
    )
    _contract(
        "SFTTrainer._set_signature_columns_if_needed",
        "hf_stable_index" in trained._signature_columns,
        "the signature-column list no longer accepts extra per-example columns",
    )
    for attr in ("_metrics", "_total_train_tokens", "_tp_size", "aux_loss_enabled", "router_aux_loss_coef"):
        _contract(f"SFTTrainer.{attr}", hasattr(trained, attr))
    _contract("SFTTrainer._metrics", isinstance(trained._metrics["train"]["mean_p"], list))
    card_params = _params(SFTTrainer.create_model_card)[1:]
    _contract("SFTTrainer.create_model_card", card_params == ["model_name", "dataset_name", "tags"], str(card_params))


def test_checkpoint_layout(trained):
    """`Trainer._save_checkpoint` writes `checkpoint-<step>` under `_get_output_dir(trial)`; hf_stable adds its state
    there, and `training_args.bin` is the pickled args (what `TokenFreeConfigMixin` guards)."""
    import os

    folder = os.path.join(trained.args.output_dir, "checkpoint-1")
    for name in ("hf_stable_state.json", "trainer_state.json", "training_args.bin"):
        _contract("Trainer._save_checkpoint", os.path.isfile(os.path.join(folder, name)), f"no {name} in {folder}")


def test_trl_parser_and_accelerate_launcher():
    from accelerate.commands.launch import launch_command, launch_command_parser
    from trl import TrlParser

    got = _params(TrlParser.parse_args_and_config)[1:]
    _contract(
        "TrlParser.parse_args_and_config",
        got[:4] == ["args", "return_remaining_strings", "fail_with_unknown_args", "separate_remaining_strings"],
        str(got),
    )
    parsed = launch_command_parser().parse_args(["--num_processes", "2", "script.py", "--x", "1"])
    _contract(
        "accelerate launch_command_parser",
        parsed.training_script == "script.py"
        and parsed.training_script_args == ["--x", "1"]
        and callable(launch_command),
    )


# ---------------------------------------------------------------------------------------------------------------------
# GRPO hooks


@pytest.fixture(scope="module")
def grpo_trained(tmp_path_factory):
    from grpo_helpers import grpo_run

    _, trainer = grpo_run(
        tmp_path_factory.mktemp("grpo-contract"), advantage_estimator="maxrl", correctness_reward_index=0
    )
    return trainer


def test_grpo_hooks_exist_with_their_signatures():
    from trl import GRPOTrainer

    expected = {
        "_calculate_rewards": ["inputs", "prompts", "completions", "completion_ids_list"],
        "_generate_and_score_completions": ["inputs"],
        "_compute_loss": ["model", "inputs"],
        "_get_per_token_logps_and_entropies": ["model", "input_ids", "attention_mask", "logits_to_keep"],
        "_tokenize_prompts": ["prompts"],
        "training_step": ["model", "inputs", "num_items_in_batch"],
    }
    for name, params in expected.items():
        got = _params(getattr(GRPOTrainer, name))[1:]
        _contract(f"GRPOTrainer.{name}", got[: len(params)] == params, f"signature is now {got}")
    _contract(
        "GRPOTrainer.loss_is_scaled_for_ga",
        GRPOTrainer.loss_is_scaled_for_ga is True,
        "GRPO losses are divided for accumulation inside `_compute_loss`",
    )


def test_grpo_calculate_rewards_returns_gathered_matrix(grpo_trained):
    """`_calculate_rewards` returns `(N_global, K)`; `_generate_and_score_completions` returns the local slice with
    `advantages`, `completion_mask`, `completion_ids`, `num_items_in_batch`; `_logs` keeps per-completion rows."""
    rewards = grpo_trained._stash_rewards
    _contract("GRPOTrainer._calculate_rewards", rewards is not None and rewards.shape == (8, 2), str(rewards))
    logs = grpo_trained._logs
    _contract(
        "GRPOTrainer._logs",
        len(logs["advantages"]) == 8 and set(logs["rewards"]) == {"arithmetic_reward", "length_reward"},
        str({k: len(v) for k, v in logs.items()}),
    )
    for attr in (
        "reward_weights",
        "reward_func_names",
        "num_generations",
        "num_generations_eval",
        "eos_token_ids",
        "max_completion_length",
        "_metrics",
    ):
        _contract(f"GRPOTrainer.{attr}", hasattr(grpo_trained, attr))


def test_grpo_rollout_func_and_generation_helpers():
    from trl import GRPOTrainer
    from trl.models.utils import unwrap_model_for_generation

    _contract("GRPOTrainer(rollout_func=...)", "rollout_func" in _params(GRPOTrainer.__init__))
    _contract(
        "trl.models.utils.unwrap_model_for_generation",
        _params(unwrap_model_for_generation)[:2] == ["model", "accelerator"],
    )


# ---------------------------------------------------------------------------------------------------------------------
# PEFT and bitsandbytes hooks the adapters rely on (hf_stable/adapters/, hf_stable/_peft_hook.py)


def test_peft_lora_variant_interface():
    from peft.tuners.lora.layer import Linear, LoraLayer, LoraVariant

    for name in ("init", "merge_safe", "merge_unsafe", "unmerge", "forward"):
        _contract(f"LoraVariant.{name}", callable(getattr(LoraVariant, name, None)))
    _contract("LoraVariant.forward", _params(LoraVariant.forward)[:4] == ["module", "active_adapter", "x", "result"])
    _contract("LoraLayer.resolve_lora_variant", "config" in _params(LoraLayer.resolve_lora_variant))
    _contract("Linear.lora_variants", isinstance(inspect.getattr_static(Linear, "lora_variants"), property))


def test_peft_variant_resolution_and_custom_module_dispatch():
    """`is_lora_variant` fields select our variant, and `_register_custom_module` makes PEFT build our layer."""
    from peft import get_peft_model

    from hf_stable.adapters import StableLoraConfig
    from hf_stable.adapters.layers import StableLinear
    from hf_stable.adapters.map import MapLinearVariant

    field = StableLoraConfig.__dataclass_fields__["use_map"]
    _contract("LoraConfig field metadata is_lora_variant", field.metadata.get("is_lora_variant") is True)
    model, _ = build_tiny_model(seed=0)
    peft_model = get_peft_model(model, StableLoraConfig(r=2, target_modules=["q_proj"], use_map=True))
    layer = peft_model.base_model.model.model.layers[0].self_attn.q_proj
    _contract("LoraConfig._register_custom_module / LoraModel._create_new_module", isinstance(layer, StableLinear))
    _contract("LoraLayer.update_layer -> variant.init", isinstance(layer.lora_variant["default"], MapLinearVariant))
    _contract("adapter_layer_names", "lora_map_a" in layer.adapter_layer_names)


def test_peft_from_peft_type_is_wrapped():
    """Stock loading builds configs through `PeftConfigMixin.from_peft_type`; hf_stable wraps it."""
    from peft.config import PeftConfigMixin

    import hf_stable  # noqa: F401  (installs the wrapper)
    from hf_stable.adapters import StableLoraConfig

    _contract("PeftConfigMixin.from_peft_type", getattr(PeftConfigMixin.from_peft_type, "_hf_stable", False))
    _contract("PeftConfigMixin._get_peft_type", getattr(PeftConfigMixin._get_peft_type, "_hf_stable", False))
    config = PeftConfigMixin.from_peft_type(peft_type="LORA", r=2, target_modules=["q_proj"], use_map=True)
    _contract("PeftConfigMixin.from_peft_type(**saved)", isinstance(config, StableLoraConfig) and config.use_map)


def test_bitsandbytes_cpu_4bit_internals():
    """4-bit bases: PEFT's bnb layer, the dequantiser and bitsandbytes' CPU repacking that `_quant` undoes."""
    pytest.importorskip("bitsandbytes")
    import bitsandbytes as bnb
    import bitsandbytes.functional as F
    from peft.tuners.lora.bnb import Linear4bit
    from peft.utils.integrations import dequantize_module_weight

    _contract("peft.tuners.lora.bnb.Linear4bit", issubclass(Linear4bit, torch.nn.Module))
    _contract("dequantize_module_weight", _params(dequantize_module_weight)[:1] == ["module"])
    _contract(
        "bnb.functional._convert_weight_packed_for_cpu_inverse", hasattr(F, "_convert_weight_packed_for_cpu_inverse")
    )
    _contract("bnb.functional.dequantize_4bit", callable(F.dequantize_4bit))
    layer = bnb.nn.Linear4bit(64, 64, bias=False, quant_type="nf4", compute_dtype=torch.float32)
    layer.weight = bnb.nn.Params4bit(torch.randn(64, 64), requires_grad=False, quant_type="nf4")
    layer = layer.to("cpu")
    _contract("Params4bit.quant_state", getattr(layer.weight, "quant_state", None) is not None)
    from hf_stable.adapters._quant import dequantized_weight

    before = dequantize_module_weight(layer).clone()
    layer.eval()
    with torch.no_grad():
        layer(torch.randn(2, 64))
    repacked = getattr(layer.weight.quant_state, "packing_format_for_cpu", False)
    _contract(
        "Linear4bit.support_avx512bf16_for_cpu -> QuantState.packing_format_for_cpu",
        repacked == bool(getattr(layer, "support_avx512bf16_for_cpu", False)),
        "bitsandbytes changed when it repacks 4-bit weights for its CPU kernel.",
    )
    # repacked or not, the dequantised weight is the loaded one (up to the bf16 block scales of the repacked form)
    torch.testing.assert_close(
        dequantized_weight(layer).float(), before.float(), rtol=0, atol=1e-2 * before.abs().max().item()
    )
