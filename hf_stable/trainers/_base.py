"""What every hf_stable trainer shares: state that survives checkpoints and resume, the model card and the
conversion of plain TRL/transformers configs.

A trainer keeps what it learns while training (multipliers, probe results, adaptive weights) in
``_stable_state()``; it is written into each ``checkpoint-N`` folder next to the optimizer state and read back by
``train(resume_from_checkpoint=...)`` before the loop starts, so a resumed run continues exactly where it stopped.
Tensors go to safetensors (never pickle), the rest to JSON. The whole checkpoint is written into a staging folder
and renamed to ``checkpoint-N`` once complete, our state last ([`_atomic`]); ``resume_from_checkpoint=True`` takes the
newest complete checkpoint.

[`StableTrainerMixin`] builds the card and coerces `args` from class attributes, after TRL's `_tag_names`/`_name`
pattern (`trl/trainer/base_trainer.py`): a trainer names its config class and the registries whose active methods the
card lists, and adds what only it knows in `_card_sections()`.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os

import torch
from safetensors.torch import load_file, save_file
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from ..cards import CardSections, TrainingCard, method_sections, write_training_card
from ..stability.nograd import repair_trl_fused_forwards
from ..stability.signals import StabilitySignalsMixin
from ._atomic import (
    STAGING_PREFIX,
    TRAINER_STATE,
    last_complete_checkpoint,
    publish_files,
    publish_folder,
    staging,
)
from ._refusals import refuse_unrunnable


logger = logging.getLogger(__name__)

STATE_TENSORS = "hf_stable_state.safetensors"
STATE_JSON = "hf_stable_state.json"


def write_json_atomic(path: str, payload: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=2, sort_keys=True)
    os.replace(tmp, path)


def save_stable_state(folder: str, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    os.makedirs(folder, exist_ok=True)
    if tensors:
        tmp = os.path.join(folder, STATE_TENSORS + ".tmp")
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, tmp)
        os.replace(tmp, os.path.join(folder, STATE_TENSORS))
    write_json_atomic(os.path.join(folder, STATE_JSON), meta)


def load_stable_state(folder: str) -> tuple[dict[str, torch.Tensor], dict] | None:
    """The state saved in ``folder``, or ``None`` when the folder holds no hf_stable state."""
    meta_path = os.path.join(folder, STATE_JSON)
    if not os.path.isfile(meta_path):
        return None
    with open(meta_path, encoding="utf-8") as f:
        meta = json.load(f)
    tensor_path = os.path.join(folder, STATE_TENSORS)
    tensors = load_file(tensor_path) if os.path.isfile(tensor_path) else {}
    return tensors, meta


class TokenFreeConfigMixin:
    """Mix into a `TrainingArguments` subclass: pickles (`training_args.bin`, which `Trainer` writes at every save)
    never contain `hub_token`. Deep copies keep it."""

    def __getstate__(self):
        state = dict(self.__dict__)
        if state.get("hub_token") is not None:
            state["hub_token"] = None
        return state

    def __deepcopy__(self, memo):
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new


class StableStateMixin:
    """Mix into a `transformers.Trainer` subclass (before the TRL trainer in the bases)."""

    def _stable_state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """``(tensors, json_meta)`` to checkpoint; override in trainers that learn state."""
        return {}, {}

    def _load_stable_state(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        """Restore what ``_stable_state`` returned."""

    _staging: str | None = None  # the staging folder while `_save_checkpoint` runs
    _deferred_push: str | None = None

    def _get_output_dir(self, trial):
        # While a checkpoint is saved the parent writes `<staging>/checkpoint-N` and rotates only inside it.
        return self._staging if self._staging is not None else super()._get_output_dir(trial)

    def _push_from_checkpoint(self, checkpoint_folder):
        if self._staging is not None:  # pushed once the folder has its final name
            self._deferred_push = checkpoint_folder
            return None
        return super()._push_from_checkpoint(checkpoint_folder)

    def _save_checkpoint(self, model, trial):
        """Write the whole checkpoint (weights, optimizer, scheduler, RNG, trainer state, hf_stable's state last) into
        ``tmp-checkpoint-N/checkpoint-N``, fsync it and rename it to ``checkpoint-N`` (see `_atomic`); then push
        and rotate as the parent would. Every rank computes the same folder from the step; ranks that write (RNG
        files, optimizer shards) finish before the main process renames.

        A callback whose state must be part of the checkpoint defines ``write_checkpoint_state(folder, args, state)``:
        it is called on every rank with the staged folder, before hf_stable's state (``on_save`` runs only after the
        rename, outside the atomic save). Written by a writing rank (``args.should_save``)."""
        run_dir = super()._get_output_dir(trial)
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        final = os.path.join(run_dir, name)
        staging_dir = os.path.join(run_dir, STAGING_PREFIX + name)
        staged = os.path.join(staging_dir, name)
        try:
            with staging(staging_dir, staged, final, self.args.should_save):
                self.accelerator.wait_for_everyone()
                self._staging, self._deferred_push = staging_dir, None
                super()._save_checkpoint(model, trial)
                if self.state.best_model_checkpoint == staged:  # the parent found the best one under its staging name
                    self.state.best_model_checkpoint = final
                    if self.args.should_save:
                        self.state.save_to_json(os.path.join(staged, TRAINER_STATE))
                for callback in self.callback_handler.callbacks:  # state a callback keeps beside the checkpoint
                    write = getattr(callback, "write_checkpoint_state", None)
                    if write is not None:
                        write(staged, self.args, self.state)
                if self.args.should_save:
                    save_stable_state(staged, *self._stable_state())
                self.accelerator.wait_for_everyone()
                if self.args.should_save and os.path.isdir(staged):  # absent: a node sharing the filesystem renamed it
                    publish_folder(staged, final)
                    os.rmdir(staging_dir)
        finally:
            self._staging = None
        self.accelerator.wait_for_everyone()
        if self._deferred_push is not None:
            self._deferred_push = None
            self._push_from_checkpoint(final)
        if self.args.should_save:
            rotate_checkpoints(
                output_dir=run_dir,
                save_total_limit=self.args.save_total_limit,
                best_model_checkpoint=self.state.best_model_checkpoint,
                use_mtime=True,
            )

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Save the model into ``output_dir`` through a staging folder inside it: every file appears whole and
        ``config.json``/``adapter_config.json`` appear last (see `_atomic.publish_files`: the folder also holds
        checkpoints and logs, so it cannot be renamed whole). A failed write raises an `OSError` naming the folder
        and leaves the staging folder removed and the earlier files in place."""
        if self._staging is not None:  # a checkpoint: the whole folder is already staged
            return super().save_model(output_dir, _internal_call)
        final = output_dir if output_dir is not None else self.args.output_dir
        staged = os.path.join(final, STAGING_PREFIX + "save_model")
        with staging(staged, staged, final, self.args.should_save):
            self.accelerator.wait_for_everyone()
            super().save_model(staged, _internal_call=True)
            self.accelerator.wait_for_everyone()
            if self.args.should_save:
                publish_files(staged, final)
        self.accelerator.wait_for_everyone()
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _last_complete_checkpoint(self) -> str:
        """What ``resume_from_checkpoint=True`` resumes from: the newest complete checkpoint of ``output_dir``,
        saying which newer folders it passed over and why."""
        output_dir = self.args.output_dir
        found, skipped = last_complete_checkpoint(output_dir) if os.path.isdir(output_dir) else (None, [])
        for name, why in skipped:
            logger.warning(f"resume_from_checkpoint=True skips {os.path.join(output_dir, name)}: {why}.")
        if found is None:
            raise ValueError(
                f"resume_from_checkpoint=True found no complete checkpoint in output_dir={output_dir!r}"
                + (f" (skipped: {', '.join(name for name, _ in skipped)})" if skipped else "")
                + "; pass a checkpoint folder, or `resume_from_checkpoint=None` to start afresh."
            )
        logger.info(f"resume_from_checkpoint=True resumes from {found}.")
        return found

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        # Callbacks that measure (e.g. `AdapterScaleCallback`) hand their metrics over here, before `Trainer.log`
        # calls the `report_to` integrations, which run ahead of user callbacks and would miss them in `on_log`.
        for callback in self.callback_handler.callbacks:
            pop = getattr(callback, "pop_pending_metrics", None)
            if pop is not None:
                logs.update(pop())
        return super().log(logs, *args, **kwargs)

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs):
        checkpoint = resume_from_checkpoint
        if checkpoint is True:
            checkpoint = resume_from_checkpoint = self._last_complete_checkpoint()
        if isinstance(checkpoint, (str, os.PathLike)):
            saved = load_stable_state(os.fspath(checkpoint))
            if saved is None:
                logger.warning(f"{checkpoint} holds no hf_stable state ({STATE_JSON}); learned state starts afresh.")
            else:
                self._load_stable_state(*saved)
        return super().train(
            resume_from_checkpoint=resume_from_checkpoint,
            trial=trial,
            ignore_keys_for_eval=ignore_keys_for_eval,
            **kwargs,
        )


class AdapterOptimizerMixin:
    """MAP adapters in the optimiser: no weight decay on MAP parameters (decay on A, B shrinks ‖BA‖, which *raises*
    the effective step of the scale-invariant direction) and the scalars' own `map_scalar_lr`."""

    def get_decay_parameter_names(self, model) -> list[str]:
        from ..adapters.optim import map_parameter_names

        scalars, factors = map_parameter_names(model)
        return [n for n in super().get_decay_parameter_names(model) if n not in scalars and n not in factors]

    def create_optimizer(self, model=None):
        created = self.optimizer is None
        optimizer = super().create_optimizer(model)
        if created:
            from ..adapters.optim import map_scalar_lr, split_map_scalar_group

            lr = map_scalar_lr(self.model)
            if lr is not None:
                split_map_scalar_group(optimizer, self.model, lr)
        return optimizer


class StableTrainerMixin:
    """Mix into an hf_stable trainer (before the TRL/transformers trainer in the bases). Class attributes:

    - ``_config_class``: the config dataclass `args` is coerced to ([`_coerce_args`]);
    - ``_output_suffix``: the default `output_dir` is `<model name>-<suffix>`;
    - ``_card_registries``: the registries whose active methods (value, paper, settings) the card lists;
    - ``_card_settings``: training arguments written to the card's settings;
    - ``_trl_trainer``, ``_card_example_prompt``, and TRL's ``_tag_names``.

    Override ``_card_sections(**kwargs)`` to add lines, settings, papers or tags (e.g. a resolved objective, learned
    state, evaluation metrics passed to `create_model_card(..., metrics=...)`).
    """

    _config_class: type
    _output_suffix = "hf_stable"
    _card_registries: tuple = ()
    _card_settings: tuple[str, ...] = ("learning_rate", "max_steps")
    _trl_trainer = "transformers.Trainer"
    _card_example_prompt = "Hello"

    @classmethod
    def _coerce_args(cls, model, args):
        """``args`` as ``_config_class``: itself, a default (no args), or converted from another `TrainingArguments`
        (an `SFTConfig`, `GRPOConfig`, ...) keeping every value; refused when it cannot run ([`refuse_unrunnable`]).
        Called first by every hf_stable trainer, so it also repairs, in place, a model whose TRL fused forward reaches
        another model object ([`repair_trl_fused_forwards`]: the deep-copy trap)."""
        args = cls._convert_args(model, args)
        refuse_unrunnable(args)
        repair_trl_fused_forwards(model, cls.__name__)
        return args

    @classmethod
    def _convert_args(cls, model, args):
        config_class = cls._config_class
        if args is None:
            name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "model")
            return config_class(f"{str(name).rstrip('/').split('/')[-1]}-{cls._output_suffix}")
        if isinstance(args, config_class):
            return args
        from transformers import TrainingArguments

        if isinstance(args, TrainingArguments):  # not to_dict(): it masks every *_token field with a placeholder
            values = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.init}
            if values.get("steps_per_generation") is not None:
                values["generation_batch_size"] = None  # TRL derives it from steps_per_generation; both would clash
            return config_class(**values)
        raise TypeError(
            f"`args` must be a {config_class.__name__} or another `TrainingArguments`, got {type(args).__name__}."
        )

    def _card_sections(self, **kwargs) -> CardSections:
        return CardSections()

    def create_model_card(self, model_name=None, dataset_name=None, tags=None, **kwargs):
        """Write `README.md` in `output_dir` (main process only): the active methods with their settings and papers,
        the trainer's own sections, the adapters, and the training settings named by `_card_settings`."""
        if not self.is_world_process_zero():
            return
        from ..adapters.card import adapter_card_info

        args = self.args
        sections = method_sections(args, self._card_registries).extend(self._card_sections(**kwargs))
        papers, lines, settings, adapter_tags = adapter_card_info(self.model)
        sections.extend(CardSections(lines, settings, papers, adapter_tags))
        sections.settings.update({name: getattr(args, name) for name in self._card_settings})
        user_tags = [tags] if isinstance(tags, str) else list(tags or [])
        card = TrainingCard(
            trainer_name=type(self).__name__,
            trl_trainer=self._trl_trainer,
            method=sections.method_text(),
            settings=sections.settings,
            tags=[*self._tag_names, *sections.tags, *user_tags],
            citations=[p.bibtex for p in sections.papers],
            example_prompt=self._card_example_prompt,
        )
        base = getattr(self.accelerator.unwrap_model(self.model).config, "_name_or_path", None)
        write_training_card(
            card,
            args.output_dir,
            model_name=model_name or os.path.basename(os.path.abspath(args.output_dir)),
            base_model=base,
            hub_model_id=self.hub_model_id if args.push_to_hub else None,
            dataset_name=dataset_name,
        )


class StableTrainerBase(StabilitySignalsMixin, StableStateMixin, StableTrainerMixin, AdapterOptimizerMixin):
    """The part every hf_stable trainer shares, first in its bases: ``class XTrainer(StableTrainerBase, <its own
    mixins>, <TRL/transformers trainer>)``. Each piece overrides trainer methods and calls ``super()``:

    - `StabilitySignalsMixin`: ``training_step``, ``_get_grad_norm`` (the loss and pre-clip norm of each step);
    - `StableStateMixin`: ``train`` (resume), ``log``, ``_save_checkpoint``, ``save_model``, ``_get_output_dir``,
      ``_push_from_checkpoint`` (the atomic checkpoint);
    - `StableTrainerMixin`: ``_coerce_args``, ``create_model_card`` and the card's class attributes;
    - `AdapterOptimizerMixin`: ``create_optimizer``, ``get_decay_parameter_names`` (MAP parameter groups).

    The pieces share no method, so their order among themselves changes nothing; it is fixed here so that every
    trainer resolves them alike. Being first, they wrap the trainer's own mixins: `OwnForwardMixin.train` (SFT) runs
    inside `StableStateMixin.train`, so the saved state is loaded before the fused forward is attached (loading runs
    no forward); the checkpoint is staged around everything the inner ``_save_checkpoint`` writes.
    `tests/trainers/test_composition.py` keeps this: same first base everywhere, no piece listed again."""
