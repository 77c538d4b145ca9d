"""Import cost of hf_stable, measured in fresh interpreters and printed next to its baselines.

    python benchmarks/import_time.py [--repeats 5]

Rows: `import torch` (the floor), `import torch; import hf_stable` (the lazy package: the issue's budget is 1.5 s on
top of torch), `from hf_stable import StableSFTTrainer` (pulls in TRL) against `from trl import SFTTrainer`.
Median of the repeats; each statement runs in its own `python -c`, so nothing is cached between them.
"""

import argparse
import statistics
import subprocess
import sys
import time


STATEMENTS = {
    "import torch": "import torch",
    "import torch; import hf_stable": "import torch; import hf_stable",
    "from trl import SFTTrainer": "from trl import SFTTrainer",
    "from hf_stable import StableSFTTrainer": "from hf_stable import StableSFTTrainer",
}


def measure(statement: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", statement], check=True, capture_output=True)
    return time.perf_counter() - start


def main(repeats: int) -> dict[str, float]:
    times = {name: [] for name in STATEMENTS}
    for _ in range(repeats):  # interleaved, so background load hits every row alike
        for name, statement in STATEMENTS.items():
            times[name].append(measure(statement))
    median = {name: statistics.median(t) for name, t in times.items()}
    print(f"{'statement':<42} {'median s':>9}")
    for name, value in median.items():
        print(f"{name:<42} {value:>9.2f}")
    on_top = median["import torch; import hf_stable"] - median["import torch"]
    trainer_ratio = median["from hf_stable import StableSFTTrainer"] / median["from trl import SFTTrainer"]
    print(f"\nimport hf_stable on top of torch: {on_top:+.2f} s (budget 1.5 s)")
    print(f"StableSFTTrainer import / TRL SFTTrainer import: {trainer_ratio:.2f}x")
    return median


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    main(parser.parse_args().repeats)
