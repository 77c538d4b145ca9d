"""Bad configurations fail early — at config or trainer construction — with a message naming the field."""

import pytest
from datasets import Dataset, IterableDataset

from hf_stable import StableSFTConfig, StableSFTTrainer
from hf_stable.scripts.sft import make_parser
from hf_stable.testing import arithmetic_dataset, build_tiny_model


def _config(tmp_path, **kwargs):
    return StableSFTConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"sft_objective": "nlll"}, "sft_objective"),
        ({"sft_objective": "prob_power", "objective_alpha": -0.5}, "objective_alpha"),
        ({"sft_objective": "prob_power", "objective_alpha": float("nan")}, "objective_alpha"),
        ({"sft_objective": "prob_power", "objective_alpha": float("inf")}, "objective_alpha"),
        ({"sft_objective": "threshold", "threshold": 1.5}, "threshold"),
        ({"sft_objective": "threshold", "threshold": -0.1}, "threshold"),
        ({"sft_objective": "threshold", "threshold_quantile": 2.0}, "threshold_quantile"),
        ({"sft_objective": "threshold"}, "threshold_quantile"),
        ({"sft_objective": "threshold", "threshold": 0.5, "threshold_quantile": 0.2}, "threshold_quantile"),
        ({"sft_objective": "prob_power", "threshold": 0.5}, "threshold"),
        ({"sft_objective": "threshold", "threshold": 0.5, "threshold_kind": "top"}, "threshold_kind"),
        ({"threshold_normalization": "tokens"}, "threshold_normalization"),
        ({"sft_objective": "prob_power", "loss_type": "dft"}, "loss_type"),
        ({"sft_objective": "auto", "auto_rule": {"median": 0.5}}, "auto_rule"),
        ({"auto_probe_batches": 0}, "auto_probe_batches"),
        ({"sequence_objective": "dpo"}, "sequence_objective"),
        ({"sequence_objective": "redi", "sft_objective": "prob_power"}, "sft_objective"),
        ({"sequence_objective": "redi", "redi_neg_weight": -1.0}, "redi_neg_weight"),
        ({"sequence_objective": "redi", "redi_reduction": "batch"}, "redi_reduction"),
        ({"sequence_objective": "redi", "packing": True, "max_length": 32}, "packing"),
        ({"sample_reweighting": "feasible", "packing": True, "max_length": 32}, "packing"),
        ({"sample_reweighting": "feasible", "sequence_objective": "redi"}, "sample_reweighting"),
        ({"sample_reweighting": "dro"}, "sample_reweighting"),
        ({"sample_reweighting": "feasible", "fl_dual_lr": 0.0}, "fl_dual_lr"),
        ({"sample_reweighting": "feasible", "fl_target_prob": 0.0}, "fl_target_prob"),
        ({"sample_reweighting": "feasible", "fl_resilient_rho": -1.0}, "fl_resilient_rho"),
        ({"sample_reweighting": "feasible", "threshold_normalization": "active"}, "threshold_normalization"),
    ],
)
def test_bad_config_raises_naming_the_field(tmp_path, kwargs, field):
    with pytest.raises(ValueError, match=field):
        _config(tmp_path, **kwargs)


def test_unknown_objective_lists_the_valid_ones(tmp_path):
    with pytest.raises(ValueError) as error:
        _config(tmp_path, sft_objective="p")
    for name in ("nll", "prob_power", "threshold", "auto"):
        assert f"'{name}'" in str(error.value)


def test_normalisation_defaults(tmp_path):
    assert _config(tmp_path, sft_objective="threshold", threshold=0.5).threshold_normalization == "active"
    assert _config(tmp_path, sft_objective="prob_power").threshold_normalization == "supervised"
    fl = _config(tmp_path, sample_reweighting="feasible", sft_objective="threshold", threshold=0.5)
    assert fl.threshold_normalization == "supervised"  # per-sample means are per-sequence
    assert _config(tmp_path, sample_reweighting="feasible", fl_target_prob=0.5).feasibility_epsilon == pytest.approx(
        0.6931471805599453
    )


def test_default_config_does_not_own_the_loss(tmp_path):
    assert not _config(tmp_path).owns_loss
    assert _config(tmp_path, sft_objective="auto").owns_loss


def test_redi_without_sign_column_raises_at_trainer_construction(tmp_path):
    model, tokenizer = build_tiny_model()
    args = _config(tmp_path, sequence_objective="redi")
    with pytest.raises(ValueError, match="redi_sign"):
        StableSFTTrainer(model=model, args=args, train_dataset=arithmetic_dataset(4), processing_class=tokenizer)


def test_redi_bad_sign_values_raise(tmp_path):
    model, tokenizer = build_tiny_model()
    data = Dataset.from_list([{"prompt": "1+1=", "completion": "2", "redi_sign": s} for s in (1, 0, -1)])
    with pytest.raises(ValueError, match="redi_sign"):
        StableSFTTrainer(
            model=model,
            args=_config(tmp_path, sequence_objective="redi"),
            train_dataset=data,
            processing_class=tokenizer,
        )


def test_feasible_learning_needs_a_sized_dataset(tmp_path):
    model, tokenizer = build_tiny_model()
    rows = list(arithmetic_dataset(8))
    stream = IterableDataset.from_generator(lambda: iter(rows))
    args = _config(tmp_path, sample_reweighting="feasible", max_steps=1)
    with pytest.raises(ValueError, match="IterableDataset"):
        StableSFTTrainer(model=model, args=args, train_dataset=stream, processing_class=tokenizer)


def test_compute_loss_func_with_own_objective_raises(tmp_path):
    model, tokenizer = build_tiny_model()
    with pytest.raises(ValueError, match="compute_loss_func"):
        StableSFTTrainer(
            model=model,
            args=_config(tmp_path, sft_objective="prob_power"),
            train_dataset=arithmetic_dataset(4),
            processing_class=tokenizer,
            compute_loss_func=lambda outputs, labels, num_items_in_batch=None: outputs.loss,
        )


def test_plain_sft_config_is_accepted(tmp_path):
    """A TRL `SFTConfig` (or `TrainingArguments`) is converted, keeping its values."""
    from trl import SFTConfig

    model, tokenizer = build_tiny_model()
    args = SFTConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, learning_rate=0.123, report_to="none")
    trainer = StableSFTTrainer(model=model, args=args, train_dataset=arithmetic_dataset(4), processing_class=tokenizer)
    assert isinstance(trainer.args, StableSFTConfig)
    assert trainer.args.learning_rate == 0.123 and trainer.args.sft_objective == "nll"


def test_cli_parser_help_and_yaml_values(tmp_path):
    """Every field renders in `--help` (a lone `%` would crash argparse) and parses from the command line."""
    parser = make_parser(prog="hf-stable sft")
    assert "--sft_objective" in parser.format_help() and "--fl_resilient_rho" in parser.format_help()
    config = tmp_path / "c.yaml"
    config.write_text(
        "model_name_or_path: x\noutput_dir: o\nuse_cpu: true\nbf16: false\nsft_objective: threshold\n"
        "threshold_quantile: 0.2\nauto_rule: '{\"strong_median\": 0.8}'\nfl_resilient_rho: null\n"
    )
    _, args, _, _ = parser.parse_args_and_config(["--config", str(config)])
    assert args.sft_objective == "threshold" and args.threshold_quantile == 0.2
    assert args.auto_rule == {"strong_median": 0.8} and args.fl_resilient_rho is None
    with pytest.raises(ValueError, match="objective_alpha"):
        parser.parse_args_and_config(
            [
                "--config",
                str(config),
                "--sft_objective",
                "prob_power",
                "--threshold_quantile",
                "None",
                "--objective_alpha",
                "-1",
            ]
        )
