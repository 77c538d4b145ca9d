"""UnlearningTrainer: each method's loss against an independent computation, accumulation invariance, the identities
between methods, resume with the dual variable, the callbacks and the refusals."""

import math
import os

import pytest
import torch
from sft_helpers import assert_same_update
from unlearn_helpers import GLOBAL_BATCH, METHODS, STEP_ARGS, split_data, unlearn_update

from hf_stable import UnlearningConfig, UnlearningTrainer
from hf_stable.testing import build_tiny_model


def _answer_logps(model, tokenizer, rows):
    """Per-row answer log-probabilities (answer + EOS) in float64, from plain per-row forwards (no padding)."""
    from hf_stable.trainers.unlearning.data import tokenize_row

    out = []
    for row in rows:
        ex = tokenize_row(tokenizer, row["prompt"], row["completion"])
        ids = torch.tensor([ex["input_ids"]])
        logprobs = torch.log_softmax(model(input_ids=ids).logits[0, :-1].double(), -1)
        targets = torch.tensor(ex["labels"][1:])
        keep = targets != -100
        out.append(logprobs[keep].gather(-1, targets[keep, None]).squeeze(-1))
    return out


@pytest.mark.parametrize("name", sorted(METHODS))
def test_accumulation_gives_the_same_update(tmp_path, name):
    full, _ = unlearn_update(tmp_path / "a", GLOBAL_BATCH, 1, **METHODS[name])
    accumulated, _ = unlearn_update(tmp_path / "b", GLOBAL_BATCH // 2, 2, **METHODS[name])
    assert_same_update(accumulated, full)


def test_graddiff_loss_equals_independent_computation(tmp_path):
    """GradDiff = −(mean forget answer-token NLL) + mean retain answer-token NLL, over the step's tokens only."""
    _, trainer = unlearn_update(tmp_path, GLOBAL_BATCH, 1, unlearn_method="graddiff", train=False)
    model, tok = trainer.model, trainer.processing_class
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(GLOBAL_BATCH)])
    forget_rows, retain_rows = split_data()
    pairs = [trainer.train_dataset._pair(i) for i in range(GLOBAL_BATCH)]
    f = _answer_logps(model, tok, [forget_rows[p[0]] for p in pairs])
    r = _answer_logps(model, tok, [retain_rows[p[1]] for p in pairs])
    expected = torch.cat(f).mean() - torch.cat(r).mean()
    model.train()
    trainer._step_counts = None  # the batch alone
    got = trainer.compute_loss(model, trainer._prepare_inputs(batch))
    assert got.item() == pytest.approx(expected.item(), rel=1e-5)


def test_npo_and_simnpo_losses_equal_independent_computation(tmp_path):
    _, trainer = unlearn_update(
        tmp_path, GLOBAL_BATCH, 1, unlearn_method="npo", retain_loss_type="none", train=False, npo_beta=0.3
    )
    model, tok = trainer.model, trainer.processing_class
    forget_rows, _ = split_data()
    batch = trainer._prepare_inputs(trainer.data_collator([trainer.train_dataset[i] for i in range(GLOBAL_BATCH)]))
    seq = torch.stack([lp.sum() for lp in _answer_logps(model, tok, forget_rows)])
    # at θ = θ_ref every sequence contributes (2/β) log 2
    assert trainer.compute_loss(model, batch).item() == pytest.approx(2 / 0.3 * math.log(2), rel=1e-5)
    assert torch.allclose(trainer._ref_seq_logps.double(), seq, atol=1e-4)

    trainer.args.unlearn_method, trainer.args.simnpo_beta, trainer.args.simnpo_margin = "simnpo", 0.7, 0.2
    trainer.args.forget_weight = 1.0
    mean_nll = torch.stack([-lp.mean() for lp in _answer_logps(model, tok, forget_rows)])
    expected = (2 / 0.7) * torch.nn.functional.softplus(0.2 - 0.7 * mean_nll).mean()
    assert trainer.compute_loss(model, batch).item() == pytest.approx(expected.item(), rel=1e-5)


def test_stableun_without_radius_or_projection_is_simnpo_plus_retain(tmp_path):
    common = dict(simnpo_beta=0.5, forget_weight=0.7)
    stable, _ = unlearn_update(
        tmp_path / "a",
        4,
        2,
        unlearn_method="stableun",
        stableun_rho=0.0,
        stableun_project=False,
        stableun_points="sam",
        **common,
    )
    simnpo, _ = unlearn_update(tmp_path / "b", 4, 2, unlearn_method="simnpo", **common)
    assert_same_update(stable, simnpo)


def test_stableun_projection_removes_the_conflict(tmp_path):
    """With projection, the forget gradient has no component against the retain gradient: the update differs from
    the unprojected one exactly when they conflicted (logged cosine < 0)."""
    projected, trainer = unlearn_update(
        tmp_path / "a",
        GLOBAL_BATCH,
        1,
        unlearn_method="stableun",
        stableun_rho=0.0,
        stableun_points="sam",
        simnpo_beta=0.5,
    )
    plain, _ = unlearn_update(
        tmp_path / "b",
        GLOBAL_BATCH,
        1,
        unlearn_method="stableun",
        stableun_rho=0.0,
        stableun_points="sam",
        simnpo_beta=0.5,
        stableun_project=False,
    )
    cos = trainer.state.log_history[0]["stable/unlearning/proj_cos"]
    assert (cos < 0) == (not torch.allclose(projected, plain))


def test_sga_with_rate_zero_is_gradient_ascent_per_sequence(tmp_path):
    sga, _ = unlearn_update(tmp_path / "a", GLOBAL_BATCH, 1, unlearn_method="sga", sga_rate="0", sga_num_normal=2)
    ga, _ = unlearn_update(tmp_path / "b", GLOBAL_BATCH, 1, unlearn_method="ga", forget_reduction="sequence")
    assert_same_update(sga, ga)


def test_pdu_lambda_never_negative_and_frozen_during_warmup(tmp_path):
    config = dict(
        unlearn_method="pdu",
        pdu_eps=50.0,
        pdu_lambda0=1.0,
        pdu_dual_lr=10.0,
        learning_rate=1e-3,
        optim="adamw_torch",
        max_steps=6,
        pdu_warmup_steps=3,
    )
    _, trainer = unlearn_update(tmp_path, 4, 1, **config)
    key = "stable/unlearning/lambda"
    lambdas = [log[key] for log in trainer.state.log_history if key in log]
    assert lambdas[:4] == [1.0] * 4  # logged before each step's update: steps 1-3 frozen, step 4 still sees 1.0
    assert all(v >= 0 for v in lambdas) and trainer.dual_variable == 0.0  # retain loss ≪ ε drives λ to 0


def test_pdu_resume_reproduces_an_uninterrupted_run(tmp_path):
    config = dict(
        unlearn_method="pdu",
        pdu_eps=2.0,
        pdu_lambda0=1.0,
        pdu_dual_lr=0.5,
        learning_rate=1e-3,
        optim="adamw_torch",
        max_steps=4,
        save_strategy="steps",
        save_steps=2,
    )
    full, trainer_full = unlearn_update(tmp_path / "full", 4, 1, **config)
    from hf_stable import UnlearningConfig as Config

    model, tok = build_tiny_model(seed=0)
    forget, retain = split_data()
    args = Config(output_dir=str(tmp_path / "full"), per_device_train_batch_size=4, **{**STEP_ARGS, **config})
    resumed = UnlearningTrainer(
        model=model, args=args, forget_dataset=forget, retain_dataset=retain, processing_class=tok
    )
    start = build_tiny_model(seed=0)[0].state_dict()
    resumed.train(resume_from_checkpoint=os.path.join(tmp_path, "full", "checkpoint-2"))
    assert resumed.dual_variable == pytest.approx(trainer_full.dual_variable, abs=1e-12)
    assert trainer_full.dual_variable != 1.0
    delta = torch.cat([(p.detach() - start[n]).flatten() for n, p in resumed.model.named_parameters()])
    assert_same_update(delta, full)


def test_bounded_lora_trains_sine_adapters_on_the_mlp(tmp_path):
    update, trainer = unlearn_update(
        tmp_path, GLOBAL_BATCH, 1, unlearn_method="graddiff", bounded_lora=True, bounded_omega=10.0, learning_rate=0.1
    )
    from hf_stable.adapters.bounded import SineLinearVariant

    layers = [m for m in trainer.model.modules() if hasattr(m, "lora_variant") and m.lora_variant]
    assert layers and all(isinstance(m.lora_variant["default"], SineLinearVariant) for m in layers)
    assert {n.split(".")[-1] for n, m in trainer.model.named_modules() if m in layers} == {
        "gate_proj",
        "up_proj",
        "down_proj",
    }
    assert update.abs().max() > 0


def test_collapse_guard_stops_gradient_ascent(tmp_path):
    forget, retain = split_data()
    model, tok = build_tiny_model(seed=0)
    args = UnlearningConfig(
        output_dir=str(tmp_path),
        unlearn_method="ga",
        per_device_train_batch_size=4,
        **{
            **STEP_ARGS,
            "max_steps": 200,
            "learning_rate": 3e-2,
            "optim": "adamw_torch",
            "collapse_guard": True,
            "collapse_check_steps": 2,
            "collapse_retain_factor": 1.5,
            "collapse_restore_best": True,
        },
    )
    trainer = UnlearningTrainer(
        model=model, args=args, forget_dataset=forget, retain_dataset=retain, processing_class=tok
    )
    trainer.train()
    tripped = trainer._guard_state.get("tripped_at")
    assert tripped is not None and trainer.state.global_step == tripped < 200
    assert any(log.get("stable/unlearning/collapsed") == 1.0 for log in trainer.state.log_history)


def test_relearn_probe_keeps_the_real_weights(tmp_path):
    _, trainer = unlearn_update(
        tmp_path, 4, 1, unlearn_method="graddiff", max_steps=2, relearn_probe_steps=3, relearn_probe_lr=1e-2
    )
    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.callback_handler.on_train_end(trainer.args, trainer.state, trainer.control)
    assert set(trainer.relearn_report) == {"acc", "prob"}
    assert all(torch.equal(weights[n], p) for n, p in trainer.model.named_parameters())


def test_model_card_says_what_was_unlearned_without_the_rows(tmp_path):
    _, trainer = unlearn_update(tmp_path, 4, 1, unlearn_method="simnpo", max_steps=1)
    trainer.create_model_card(metrics={"forget_acc": 0.1})
    card = (tmp_path / "README.md").read_text()
    assert "simnpo" in card and "2410.07163" in card and "forget_rows: 8" in card and "forget_acc" in card
    forget, _ = split_data()
    assert not any(row["prompt"] in card for row in forget)


def test_evaluate_unlearning_reports_each_set(tmp_path):
    _, trainer = unlearn_update(tmp_path, 4, 1, unlearn_method="graddiff", max_steps=1)
    report = trainer.evaluate_unlearning(holdout=split_data(seed=11)[1], print_table=False)
    for key in ("forget_acc", "forget_prob", "retain_acc", "holdout_prob", "mia_auc", "over_forgetting"):
        assert key in report and math.isfinite(report[key])
    assert 0.0 <= report["mia_auc"] <= 1.0


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"unlearn_method": "forgetall"}, "`unlearn_method`='forgetall' is not valid"),
        ({"unlearn_method": "pdu"}, "needs `pdu_eps`"),
        ({"unlearn_method": "pdu", "pdu_eps": "big"}, "pdu_eps"),
        ({"retain_loss_type": "l2"}, "retain_loss_type"),
        ({"sga_rate": "fast"}, "sga_rate"),
        ({"npo_beta": 0.0}, "npo_beta"),
        ({"stableun_points": "all"}, "stableun_points"),
    ],
)
def test_bad_config_raises_naming_the_field(tmp_path, config, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("`", "`")):
        UnlearningConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", **config)


def test_bad_data_raises_at_construction(tmp_path):
    from datasets import Dataset

    forget, retain = split_data()
    model, tok = build_tiny_model(seed=0)
    args = UnlearningConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    with pytest.raises(ValueError, match="forget_dataset` is empty"):
        UnlearningTrainer(
            model=model, args=args, forget_dataset=Dataset.from_list([]), retain_dataset=retain, processing_class=tok
        )
    with pytest.raises(ValueError, match="share 2 row"):
        overlap = Dataset.from_list([*retain.select(range(2)), *forget])
        UnlearningTrainer(model=model, args=args, forget_dataset=overlap, retain_dataset=retain, processing_class=tok)
    npo = UnlearningConfig(
        output_dir=str(tmp_path), unlearn_method="npo", precompute_ref_logps=False, use_cpu=True, report_to="none"
    )
    with pytest.raises(ValueError, match="NPO without a reference"):
        UnlearningTrainer(model=model, args=npo, forget_dataset=forget, retain_dataset=retain, processing_class=tok)
    dmm = UnlearningConfig(output_dir=str(tmp_path), unlearn_method="dmm", use_cpu=True, report_to="none")
    with pytest.raises(ValueError, match="oracle_model"):
        UnlearningTrainer(model=model, args=dmm, forget_dataset=forget, retain_dataset=retain, processing_class=tok)


def _first_batch(trainer):
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(GLOBAL_BATCH)])
    trainer._step_counts = None
    trainer.model.train()
    return trainer._prepare_inputs(batch)


def test_dmm_with_the_model_itself_as_oracle_has_zero_loss(tmp_path):
    import copy

    model, _ = build_tiny_model(seed=0)
    _, trainer = unlearn_update(
        tmp_path,
        GLOBAL_BATCH,
        1,
        unlearn_method="dmm",
        train=False,
        trainer_kwargs={"oracle_model": copy.deepcopy(model)},
    )
    assert abs(trainer.compute_loss(trainer.model, _first_batch(trainer)).item()) < 1e-6


def test_dmm_precomputed_full_vocabulary_targets_match_the_oracle(tmp_path):
    """Top-k targets with k = V reproduce the oracle's distributions exactly: zero loss when the oracle is the model;
    with a different oracle, the same loss as the live oracle."""
    from hf_stable.trainers.unlearning import precompute_dmm_targets

    forget, retain = split_data()
    oracle, tok = build_tiny_model(seed=1)
    targets = precompute_dmm_targets(oracle, forget, tok, k=oracle.config.vocab_size)
    model, _ = build_tiny_model(seed=0)
    args = UnlearningConfig(
        output_dir=str(tmp_path), unlearn_method="dmm", dmm_target="precomputed", dmm_retain_fraction=0.0, **STEP_ARGS
    )
    pre = UnlearningTrainer(
        model=model, args=args, forget_dataset=targets, retain_dataset=retain, processing_class=tok
    )
    live_args = UnlearningConfig(
        output_dir=str(tmp_path), unlearn_method="dmm", dmm_target="oracle_model", dmm_retain_fraction=0.0, **STEP_ARGS
    )
    live = UnlearningTrainer(
        model=build_tiny_model(seed=0)[0],
        args=live_args,
        forget_dataset=forget,
        retain_dataset=retain,
        processing_class=tok,
        oracle_model=oracle,
    )
    got = pre.compute_loss(pre.model, _first_batch(pre)).item()
    expected = live.compute_loss(live.model, _first_batch(live)).item()
    assert got > 1e-3 and got == pytest.approx(expected, rel=1e-4)


def test_kl_retain_under_peft_uses_the_adapter_free_base(tmp_path):
    """With LoRA, the reference for the KL retain term is the base with adapters disabled: zero at the start."""
    from peft import LoraConfig

    _, trainer = unlearn_update(
        tmp_path,
        GLOBAL_BATCH,
        1,
        unlearn_method="graddiff",
        retain_loss_type="kl",
        train=False,
        trainer_kwargs={"peft_config": LoraConfig(r=4, target_modules=["q_proj"])},
    )
    assert trainer._ref_model is None and trainer._is_peft
    assert abs(trainer._retain_term(trainer.model, _first_batch(trainer)).item()) < 1e-7


@pytest.mark.parametrize("source", ["retain_similar", "provided"])
def test_sga_normal_sources(tmp_path, source):
    kwargs = {"normal_dataset": split_data(seed=7)[1]} if source == "provided" else {}
    update, trainer = unlearn_update(
        tmp_path,
        GLOBAL_BATCH,
        1,
        unlearn_method="sga",
        sga_num_normal=2,
        sga_normal_source=source,
        trainer_kwargs=kwargs,
    )
    item = trainer.train_dataset[0]
    assert len(item["normal"]) == 2 and update.abs().max() > 0
    if source == "retain_similar":
        index = trainer.train_dataset.normal_index[0]
        assert all(any(n is trainer._retain_rows[j] for j in index) for n in item["normal"])


def test_periodic_unlearning_evaluation_is_logged(tmp_path):
    _, trainer = unlearn_update(
        tmp_path,
        4,
        1,
        unlearn_method="graddiff",
        max_steps=2,
        unlearn_eval_steps=1,
        trainer_kwargs={"holdout_dataset": split_data(seed=11)[1]},
    )
    logged = [log for log in trainer.state.log_history if "stable/unlearning/eval/forget_acc" in log]
    assert len(logged) == 2 and all(0 <= log["stable/unlearning/eval/mia_auc"] <= 1 for log in logged)
