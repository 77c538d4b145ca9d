import logging
import warnings

import pytest


@pytest.fixture(autouse=True)
def _keep_global_logging():
    """The experiment runners silence the `hf_stable` logger and every warning for their command-line runs
    (`experiments/_harness.py` `quiet()`); a test that calls them in-process must not carry that into later tests,
    which assert on those warnings."""
    logger = logging.getLogger("hf_stable")
    level = logger.level
    with warnings.catch_warnings():
        yield
    logger.setLevel(level)
