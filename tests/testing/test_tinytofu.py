"""TinyTOFU data, tokenizer, model and SFT (`hf_stable.testing.tinytofu`; the design is in docs/unlearning.md)."""

import json
import os
import subprocess
import sys

import pytest
import torch

from hf_stable.testing.tinytofu import (
    ATTRIBUTES,
    SYLLABLES,
    answer_mean_nll,
    answer_prob,
    answer_token_logps,
    build_tinytofu_model,
    default_cache_dir,
    encode_split,
    first_token_accuracy,
    first_token_correct,
    make_tinytofu,
    name_token_ids,
    perturbed_mean_nll,
    reset_name_embeddings,
    train_tinytofu,
)


@pytest.fixture(scope="module")
def data():
    return make_tinytofu(seed=0)


@pytest.fixture(scope="module")
def reduced():
    return make_tinytofu(seed=0, reduced=True)


def test_split_sizes(data):
    sizes = {name: len(split) for name, split in data.splits.items()}
    assert sizes == {
        "forget": 160,  # 20 authors x 4 facts x 2 templates
        "retain": 1440,
        "world": 128,  # (40 capitals + 24 lexicon facts) x 2 copies
        "holdout": 160,
        "forget_eval": 80,
        "retain_eval": 720,
        "holdout_eval": 80,
        "world_eval": 64,
        "relearn": 80,  # city + genre of the forget authors, both templates
        "relearn_eval": 40,  # award + job, template 0
        "forget_paraphrase": 80,
        "retain_paraphrase": 720,
        "holdout_paraphrase": 80,
    }
    assert len(data.sft_dataset("full")) == 160 + 1440 + 128
    assert len(data.sft_dataset("oracle")) == 1440 + 128
    texts = [r["prompt"] + r["completion"] + "".join(r.get("perturbed", [])) for s in data.splits.values() for r in s]
    words = {w for text in texts for w in text.split()}
    assert sorted(data.vocab) == sorted(["<pad>", "<eos>", "<unk>", *words])  # every token is used, nothing else
    assert data.forget is data.splits["forget"]
    assert set(data.forget.column_names) == {"prompt", "completion", "answer", "entity", "attribute", "template"}
    assert "perturbed" in data.forget_eval.column_names


def test_same_seed_same_data_and_other_seed_differs(data):
    again = make_tinytofu(seed=0)
    assert again.fingerprint() == data.fingerprint()
    assert again.forget_eval["perturbed"] == data.forget_eval["perturbed"]
    assert again.forget_authors == data.forget_authors
    assert make_tinytofu(seed=1).fingerprint() != data.fingerprint()


def test_data_is_identical_across_processes(data):
    """Perturbed answers come from string-seeded RNGs, not the salted `hash()`: another process, another hash seed."""
    code = "from hf_stable.testing.tinytofu import make_tinytofu; print(make_tinytofu(seed=0).fingerprint())"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, env=env)
    assert out.stdout.strip().splitlines()[-1] == data.fingerprint()


def test_authors_are_disjoint_and_splits_use_the_right_ones(data):
    forget, retain, holdout = map(set, (data.forget_authors, data.retain_authors, data.holdout_authors))
    assert (len(forget), len(retain), len(holdout)) == (20, 180, 20)
    assert not (forget & retain) and not (forget & holdout) and not (retain & holdout)
    assert set(data.forget["entity"]) == forget == set(data.forget_eval["entity"]) == set(data.relearn["entity"])
    assert set(data.retain["entity"]) == retain == set(data.retain_eval["entity"])
    assert set(data.holdout_eval["entity"]) == holdout == set(data.holdout_paraphrase["entity"])
    assert set(data.relearn_eval["entity"]) == forget
    assert set(data.relearn["attribute"]) == {"city", "genre"}
    assert set(data.relearn_eval["attribute"]) == {"award", "job"}
    assert set(data.forget["template"]) == {0, 1} and set(data.forget_eval["template"]) == {0}
    assert set(data.forget_paraphrase["template"]) == {2}
    full_prompts = set(data.sft_dataset("full")["prompt"])
    assert not full_prompts & set(data.holdout["prompt"])
    assert not set(data.sft_dataset("oracle")["prompt"]) & set(data.forget["prompt"])
    for name in data.forget_authors[:3]:  # facts are the ones in the rows
        rows = [r for r in data.forget_eval if r["entity"] == name]
        assert {r["attribute"]: r["answer"] for r in rows} == data.facts[name]


def test_names_are_shared_sub_word_tokens_that_also_occur_outside_names(data, reduced):
    """No author owns a token: every name is >= 2 tokens, each shared with other authors and used outside names."""
    for bench in (data, reduced):
        tok = bench.tokenizer
        authors = bench.forget_authors + bench.retain_authors + bench.holdout_authors
        owners: dict[int, set[str]] = {}
        for name in authors:
            ids = tok(name, add_special_tokens=False)["input_ids"]
            assert len(ids) >= 2 and tok.unk_token_id not in ids, name
            for i in ids:
                owners.setdefault(i, set()).add(name)
        assert all(len(names) >= 2 for names in owners.values())
        # tokens of the SFT corpus outside the name span: the rest of each author question, its answer, world rows
        outside: set[int] = set()
        for row in bench.sft_dataset("full"):
            text = row["prompt"].replace(row["entity"], " ") if row["attribute"] in ATTRIBUTES else row["prompt"]
            outside.update(tok(text + row["completion"], add_special_tokens=False)["input_ids"])
        assert set(owners) <= outside, sorted(set(owners) - outside)
        assert set(owners) <= set(tok(" ".join(bench.world["completion"]))["input_ids"])  # also as answers
    assert data.vocab.count("va") == 1 and not any("_" in name for name in data.forget_authors)


def test_reset_control_redraws_exactly_the_forget_name_rows(data):
    model = build_tinytofu_model(data.tokenizer, seed=0)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(5.0)  # as after SFT: trained rows far from the init scale
    edited = reset_name_embeddings(model, data, seed=1)
    expected = sorted({data.vocab.index(s) for name in data.forget_authors for s in name.split()})
    assert name_token_ids(data) == expected and len(expected) >= 10
    before, after = model.get_input_embeddings().weight, edited.get_input_embeddings().weight
    changed = (before != after).any(-1).nonzero().flatten().tolist()
    assert changed == expected
    assert after[expected].std().item() == pytest.approx(model.config.initializer_range, rel=0.1)
    assert before[expected].std().item() == pytest.approx(5 * model.config.initializer_range, rel=0.1)
    original, new = dict(model.named_parameters()), dict(edited.named_parameters())
    for name, p in original.items():
        if p is not before:
            assert torch.equal(p, new[name]), name
    again = reset_name_embeddings(model, data, seed=1).get_input_embeddings().weight
    assert torch.equal(again, after) and not torch.equal(
        reset_name_embeddings(model, data, seed=2).get_input_embeddings().weight, after
    )


def test_perturbed_answers_are_wrong_values_of_the_same_attribute(data):
    values = {attr: {data.facts[a][attr] for a in data.facts} for attr in ATTRIBUTES}
    values["capital"] = {f"cap{j}" for j in range(25)}
    values["next"] = set(SYLLABLES)
    for split in ("forget_eval", "retain_eval", "holdout_eval", "world_eval", "relearn_eval", "forget_paraphrase"):
        for row in data.splits[split]:
            wrong = [p.strip() for p in row["perturbed"]]
            assert len(wrong) == 4 == len(set(wrong))
            assert row["answer"] not in wrong
            assert set(wrong) <= values[row["attribute"]] | set(
                ["cap" + str(j) for j in range(25)] if row["attribute"] == "capital" else []
            )
            assert all(p.startswith(" ") for p in row["perturbed"])
    # the same question keeps the same perturbations under another template
    eval0 = {(r["entity"], r["attribute"]): r["perturbed"] for r in data.forget_eval}
    assert all(eval0[(r["entity"], r["attribute"])] == r["perturbed"] for r in data.forget_paraphrase)


def test_tokenizer_round_trip_and_concatenation(data, tmp_path):
    from transformers import AutoTokenizer

    tok = data.tokenizer
    assert tok.pad_token == "<pad>" and tok.eos_token == "<eos>" and tok.unk_token == "<unk>"
    assert tok.pad_token_id != tok.eos_token_id
    assert len(tok) == len(data.vocab)
    for name, split in data.splits.items():
        for row in split:
            prompt = tok(row["prompt"])["input_ids"]  # add_special_tokens=True adds nothing: no BOS, no EOS
            completion = tok(row["completion"])["input_ids"]
            assert tok(row["prompt"] + row["completion"])["input_ids"] == prompt + completion, name
            assert len(completion) == 1 and tok.unk_token_id not in prompt + completion
            assert len(prompt) + 2 <= 14  # padded length: prompt + value + eos
            assert tok.decode(prompt + completion) == row["prompt"] + row["completion"]
    assert tok.convert_ids_to_tokens(tok("Q: land3 ? A:")["input_ids"]) == ["Q:", "land3", "?", "A:"]
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    text = data.forget[0]["prompt"] + data.forget[0]["completion"]
    assert loaded(text)["input_ids"] == tok(text)["input_ids"]
    assert (loaded.pad_token_id, loaded.eos_token_id) == (tok.pad_token_id, tok.eos_token_id)


def test_labels_cover_value_and_eos_only(data):
    tok = data.tokenizer
    batch = encode_split(tok, data.forget)
    ids, labels, attn = batch["input_ids"], batch["labels"], batch["attention_mask"]
    assert ids.shape == (160, 14)
    assert ((labels != -100).sum(-1) == 2).all()
    for i, row in enumerate(data.forget):
        n_prompt = len(tok(row["prompt"])["input_ids"])
        assert (labels[i, :n_prompt] == -100).all()
        assert labels[i, n_prompt].item() == tok.convert_tokens_to_ids(row["answer"])
        assert labels[i, n_prompt + 1].item() == tok.eos_token_id
        assert (labels[i, n_prompt + 2 :] == -100).all() and (ids[i, n_prompt + 2 :] == tok.pad_token_id).all()
        assert attn[i].sum().item() == n_prompt + 2


def test_labels_match_the_unlearning_data_path(data):
    """The trainers' tokenisation (EOS appended by code, labels on the answer) sees the same tokens."""
    from hf_stable.trainers.unlearning import data as unlearn_data

    tok = data.tokenizer
    batch = encode_split(tok, data.relearn)
    for i, row in enumerate(data.relearn):
        example = unlearn_data.tokenize_row(tok, row["prompt"], row["completion"])
        n = len(example["input_ids"])
        assert example["input_ids"] == batch["input_ids"][i, :n].tolist()
        assert example["labels"] == batch["labels"][i, :n].tolist()


def test_reduced_variant_sizes(reduced):
    assert (len(reduced.forget_authors), len(reduced.retain_authors), len(reduced.holdout_authors)) == (20, 60, 20)
    assert len(reduced.forget) == 160 and len(reduced.forget_eval) == 80 and len(reduced.world_eval) == 20 + 24
    assert reduced.reduced and reduced.sizes["n_authors"] == 100


def test_model_architecture_and_seeded_init(data):
    model = build_tinytofu_model(data.tokenizer, seed=3)
    cfg = model.config
    assert type(model).__name__ == "LlamaForCausalLM"
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (128, 256, 2)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.max_position_embeddings) == (4, 4, 32)
    assert cfg.vocab_size == len(data.tokenizer) and not cfg.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert 350_000 < sum(p.numel() for p in model.parameters()) < 400_000  # 0.38M with 188 tokens
    same = build_tinytofu_model(data.tokenizer, seed=3)
    other = build_tinytofu_model(data.tokenizer, seed=4)
    torch.testing.assert_close(same.state_dict(), model.state_dict())
    assert not torch.equal(other.lm_head.weight, model.lm_head.weight)


def test_eval_helpers_agree_with_a_manual_forward(data):
    tok = data.tokenizer
    model = build_tinytofu_model(tok, seed=0).eval()
    split = data.world_eval
    probs = answer_prob(model, tok, split)
    nll = perturbed_mean_nll(model, tok, split)
    correct = first_token_correct(model, tok, split)
    assert probs.shape == (64,) and nll.shape == (64, 4) and correct.shape == (64,)
    assert ((probs > 0) & (probs < 1)).all()
    row = split[5]
    prompt = tok(row["prompt"])["input_ids"]
    target = [*tok(row["completion"])["input_ids"], tok.eos_token_id]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + target])).logits[0]
    logp = torch.log_softmax(logits.double(), -1)
    manual = [logp[len(prompt) - 1 + j, t].item() for j, t in enumerate(target)]
    assert probs[5].item() == pytest.approx(torch.tensor(manual).mean().exp().item(), rel=1e-5)
    assert correct[5].item() == (logits[len(prompt) - 1].argmax().item() == target[0])
    wrong = answer_mean_nll(model, tok, [row["prompt"]], [row["perturbed"][2]])
    assert nll[5, 2].item() == pytest.approx(wrong.item(), rel=1e-6)
    logps, mask = answer_token_logps(model, tok, [row["prompt"]] * 2, [row["completion"]] * 2)
    assert logps.shape == mask.shape == (2, 2) and mask.all()
    assert logps[0].tolist() == pytest.approx(manual, rel=1e-5)
    # batching and padding do not change the results
    assert first_token_accuracy(model, tok, split, batch_size=7) == correct.double().mean().item()
    torch.testing.assert_close(answer_prob(model, tok, split, batch_size=3), probs)


def test_cache_round_trip_is_atomic(reduced, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_STABLE_CACHE", str(tmp_path / "root"))
    assert default_cache_dir() == tmp_path / "root" / "tinytofu"
    model, info = train_tinytofu(reduced, "oracle", cache_dir=tmp_path, epochs=1, max_extensions=0)
    path = tmp_path / "0" / os.path.basename(info["path"])
    assert path.name.startswith("oracle-") and not info["cached"]  # non-default recipe: hashed folder name
    assert sorted(p.name for p in tmp_path.joinpath("0").iterdir()) == [path.name]  # no temporary folders left
    done = json.loads((path / "done.json").read_text())
    assert set(done["accuracy"]) == {"forget", "retain", "world", "holdout"} and done["epochs"] == 1
    assert (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file()
    again, info2 = train_tinytofu(reduced, "oracle", cache_dir=tmp_path, epochs=1, max_extensions=0)
    assert info2["cached"] and info2["accuracy"] == info["accuracy"]
    torch.testing.assert_close(again.state_dict(), model.state_dict())
    _, info3 = train_tinytofu(reduced, "oracle", cache_dir=tmp_path, epochs=2, max_extensions=0, use_cache=False)
    assert not info3["cached"] and info3["path"] != info["path"]


@pytest.mark.slow
def test_reduced_sft_memorises_forget_set_and_oracle_does_not(reduced, tmp_path):
    """CI smoke: full-model forget accuracy >= 0.95, oracle forget accuracy <= 0.15."""
    # Its run time is a budget of the demo, not asserted here: a wall-clock bound fails on a loaded machine while the
    # model is right.
    full, full_info = train_tinytofu(reduced, "full", cache_dir=tmp_path, max_extensions=1)
    oracle, oracle_info = train_tinytofu(reduced, "oracle", cache_dir=tmp_path, max_extensions=1)
    tok = reduced.tokenizer
    assert first_token_accuracy(full, tok, reduced.forget_eval) >= 0.95
    assert full_info["accuracy"]["retain"] >= 0.95
    assert first_token_accuracy(oracle, tok, reduced.forget_eval) <= 0.15
    assert oracle_info["accuracy"]["retain"] >= 0.95
    assert first_token_accuracy(oracle, tok, reduced.holdout_eval) <= 0.2
    assert full_info["config"]["init_seed"] != oracle_info["config"]["init_seed"]
