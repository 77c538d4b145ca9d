"""`import hf_stable` stays cheap: the public names resolve lazily (timings: benchmarks/import_time.py)."""

import subprocess
import sys

import pytest

import hf_stable


def test_import_loads_no_heavy_library():
    code = (
        "import sys, hf_stable\n"
        "heavy = [m for m in ('torch', 'transformers', 'trl', 'peft', 'datasets', 'accelerate') if m in sys.modules]\n"
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"`import hf_stable` imported {out.stdout.strip()}"


def test_lazy_exports_resolve():
    from hf_stable.trainers.sft import StableSFTConfig, StableSFTTrainer

    assert hf_stable.StableSFTTrainer is StableSFTTrainer
    assert hf_stable.StableSFTConfig is StableSFTConfig
    assert set(hf_stable.__all__) <= set(dir(hf_stable))
    with pytest.raises(AttributeError, match="NoSuchThing"):
        hf_stable.NoSuchThing  # noqa: B018
