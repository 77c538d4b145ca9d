"""`stability_guard: true` in a YAML for `hf-stable sft`: the run has the guard attached (its metrics are logged), and
`stability_guard_kwargs` comes as a YAML mapping or as a JSON string on the command line (like TRL's dict fields)."""

import json

import pytest
from test_cli_sft import CONFIG, _run, _write_config

from hf_stable.scripts.sft import make_parser


GUARD = """\
stability_guard: true
stability_guard_kwargs:
  action: skip
  min_history: 2
logging_steps: 1
disable_tqdm: true
"""


def _config(tmp_path, tiny_model_dir, extra=GUARD):
    config, out = _write_config(tmp_path, tiny_model_dir)
    config.write_text(config.read_text() + extra)
    return config, out


def test_yaml_and_command_line_reach_the_config(tmp_path, tiny_model_dir):
    config, _ = _config(tmp_path, tiny_model_dir)
    training_args = make_parser().parse_args_and_config(["--config", str(config)])[1]
    assert training_args.stability_guard is True
    assert training_args.stability_guard_kwargs == {"action": "skip", "min_history": 2}
    override = ["--config", str(config), "--stability_guard_kwargs", json.dumps({"action": "log"})]
    assert make_parser().parse_args_and_config(override)[1].stability_guard_kwargs == {"action": "log"}
    bad = ["--config", str(config), "--stability_guard_kwargs", '{"acton": "log"}']
    with pytest.raises(ValueError, match="unknown key 'acton'"):
        make_parser().parse_args_and_config(bad)


@pytest.mark.slow
def test_sft_from_yaml_runs_with_the_guard(tmp_path, tiny_model_dir):
    assert "stability_guard" not in CONFIG
    config, out = _config(tmp_path, tiny_model_dir)
    result = _run(["sft", "--config", str(config)])
    logged = [line for line in result.stdout.splitlines() if "stable/guard/skips" in line]
    assert len(logged) >= 3, result.stdout[-2000:]  # one log per step (and the run summary)
    assert (out / "model.safetensors").exists()
