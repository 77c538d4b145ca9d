import os

import pytest
import torch


# One thread per process: 3-5x faster on the 2 shared cores of CI, and what .ci/run sets too.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # tests drive GRPO with a deterministic `rollout_func`
torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def _quiet_libraries():
    import datasets
    from transformers.utils import logging

    datasets.disable_progress_bars()
    logging.set_verbosity_error()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny model + tokenizer saved once per session (safetensors), loadable with `from_pretrained`."""
    from hf_stable.testing import build_tiny_model

    path = tmp_path_factory.mktemp("tiny-model")
    build_tiny_model(save_dir=path)
    return str(path)
