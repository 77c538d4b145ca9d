"""Every shipped example config parses and validates (the CLI would reject it before launching otherwise)."""

import glob
import os

import pytest

from hf_stable.scripts.sft import make_parser


CONFIGS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "..", "examples", "configs", "sft_*.yaml")))


def test_there_are_example_configs():
    assert len(CONFIGS) >= 3


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_example_config_parses(path):
    script_args, args, model_args, _ = make_parser().parse_args_and_config(["--config", path])
    assert model_args.model_name_or_path and args.output_dir
    assert script_args.synthetic_dataset or script_args.dataset_name
    assert args.use_cpu and not args.bf16  # runnable on the CPU machines the examples target


UNLEARN_CONFIGS = sorted(
    glob.glob(os.path.join(os.path.dirname(__file__), "..", "..", "examples", "configs", "unlearn_*.yaml"))
)


@pytest.mark.parametrize("path", UNLEARN_CONFIGS, ids=os.path.basename)
def test_unlearn_example_config_parses(path):
    from hf_stable.scripts.unlearn import make_parser as unlearn_parser

    script_args, args, _ = unlearn_parser().parse_args_and_config(["--config", path])
    assert script_args.tinytofu_seed is not None or script_args.dataset_name
    assert args.output_dir and args.use_cpu and not args.bf16
    assert args.unlearn_method in ("simnpo", "pdu")


MERGE_CONFIGS = sorted(
    glob.glob(os.path.join(os.path.dirname(__file__), "..", "..", "examples", "configs", "merge_*.yaml"))
)


def test_there_are_merge_recipes():
    assert len(MERGE_CONFIGS) >= 2


@pytest.mark.parametrize("path", MERGE_CONFIGS, ids=os.path.basename)
def test_merge_recipe_parses(path):
    # The recipes name placeholder checkpoint folders, so only parsing and method/parameter validation run here.
    from hf_stable.merging.config import MergeConfig

    config = MergeConfig.from_yaml(path)
    method = config.validate()
    assert method is not None and method.name == config.merge_method
    assert len(config.models) >= 2
    assert MergeConfig.from_yaml(config.to_yaml()).to_dict() == config.to_dict()
