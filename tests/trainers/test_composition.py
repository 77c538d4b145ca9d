"""Every hf_stable trainer is ``(StableTrainerBase, <its own mixins>, <TRL/transformers trainer>)``."""

import inspect

import pytest
from transformers import Trainer
from trl import GRPOTrainer, SFTTrainer

from hf_stable.trainers._base import StableTrainerBase
from hf_stable.trainers.grpo import StableGRPOTrainer
from hf_stable.trainers.sft import StableSFTTrainer
from hf_stable.trainers.unlearning.trainer import UnlearningTrainer


TRAINERS = {StableGRPOTrainer: GRPOTrainer, StableSFTTrainer: SFTTrainer, UnlearningTrainer: Trainer}
PIECES = StableTrainerBase.__bases__


def own_methods(cls) -> set[str]:
    return {name for name, value in vars(cls).items() if not name.startswith("__") and inspect.isroutine(value)}


@pytest.mark.parametrize("trainer", TRAINERS, ids=lambda t: t.__name__)
def test_composite_first_and_parent_last(trainer):
    assert trainer.__bases__[0] is StableTrainerBase
    assert trainer.__bases__[-1] is TRAINERS[trainer]


@pytest.mark.parametrize("trainer", TRAINERS, ids=lambda t: t.__name__)
def test_no_trainer_lists_the_shared_pieces(trainer):
    assert not set(trainer.__bases__) & set(PIECES)


@pytest.mark.parametrize("trainer", TRAINERS, ids=lambda t: t.__name__)
def test_shared_pieces_resolve_in_one_order(trainer):
    mro = trainer.__mro__
    assert [mro.index(p) for p in PIECES] == list(range(2, 2 + len(PIECES)))
    for p in PIECES:  # each piece ahead of every trainer-specific mixin and the parent: it wraps them
        assert all(mro.index(p) < mro.index(base) for base in trainer.__bases__[1:])


def test_pieces_share_no_method():
    """Their order among themselves is then irrelevant: moving one cannot change which method runs."""
    names = [own_methods(p) for p in PIECES]
    assert all(names)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            assert not a & b
