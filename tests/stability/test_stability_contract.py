"""Contract: the private transformers / accelerate / torch / TRL hooks the stability callbacks rely on.

If one of these fails after an upgrade, the guard's signals, skip or trap detection would silently stop working:
fix `hf_stable/stability/{signals,update,nograd}.py` before relaxing the pins.
"""

import inspect

import torch


def test_trainer_hands_the_pre_clip_norm_to_get_grad_norm_before_the_callbacks():
    from transformers import Trainer

    params = inspect.signature(Trainer._get_grad_norm).parameters
    assert list(params)[:3] == ["self", "model", "grad_norm"]
    loop = inspect.getsource(Trainer._run_epoch)
    order = [loop.index(s) for s in ("self.training_step(", "self._clip_grad_norm(model)", "self._get_grad_norm(",
                                     "on_pre_optimizer_step", "self.optimizer.step()", "on_optimizer_step",
                                     "optimizer_step_was_skipped", "model.zero_grad()", "on_step_end")]
    assert order == sorted(order)
    assert "Returns the pre-clip gradient norm" in inspect.getdoc(Trainer._clip_grad_norm)


def test_callback_state_restore_rebuilds_instances_from_args_and_attributes():
    from transformers import Trainer

    source = inspect.getsource(Trainer._load_callback_state)
    assert "type(callback)(**args)" in source and "setattr(new_callback, attribute, value)" in source
    assert "restore_callback_states_from_checkpoint" in source


def test_accelerate_optimizer_scaler_and_overflow_flag():
    from accelerate.optimizer import AcceleratedOptimizer

    source = inspect.getsource(AcceleratedOptimizer.step)
    assert "self.scaler.step(self.optimizer, closure)" in source and "self._is_overflow" in source
    assert "_is_overflow" in inspect.getsource(AcceleratedOptimizer.step_was_skipped.fget)


def test_gradscaler_per_optimizer_inf_flags():
    from torch.amp.grad_scaler import OptState

    scaler = torch.amp.GradScaler("cpu")
    assert OptState.UNSCALED and isinstance(scaler._per_optimizer_states, dict)


def test_trl_fused_forward_is_an_instance_closure_over_the_original_forward():
    from trl.trainer import utils

    source = inspect.getsource(utils.add_fused_lm_head)
    assert "original_forward = model.forward" in source
    assert "def _fused_forward(" in source and "model.forward = types.MethodType(_fused_forward, model)" in source
