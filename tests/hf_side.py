"""The transformers side of the parity tests (`moe_jax/convert/transformers_side.py`, run
by the Python 3.11 environment `make test` builds, .venv-hf): its commands for several
pairs in one Python, and the families it builds."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.commands import ROOT

HF_PYTHON = ROOT / ".venv-hf" / "bin" / "python"
TRANSFORMERS_SIDE = ROOT / "moe_jax" / "convert" / "transformers_side.py"
MOE = (
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "DeepseekV3ForCausalLM",  # MLA with a query latent, YaRN, groups, an MTP layer
    "DeepseekV2ForCausalLM",  # V2-Lite's shape: one query projection, greedy softmax
)
DEEPSEEK = MOE[3:]
DENSE = ("LlamaForCausalLM", "Qwen2ForCausalLM")
NEEDS_HF = pytest.mark.skipif(
    not HF_PYTHON.exists(), reason="needs .venv-hf (make test builds it: requirements-hf.txt)"
)

# The transformers side's `build ARCH OUT` or `logits DIR NPZ` for several pairs in one
# Python: the script's functions called in turn, torch and transformers imported once.
_EACH_PAIR = """
import runpy, sys
from pathlib import Path
side = runpy.run_path(sys.argv[1])
command, args = sys.argv[2], sys.argv[3:]
for first, second in zip(args[::2], args[1::2], strict=True):
    if command == "build" and first == "references":  # the rotary and routing cases
        side["references"](Path(second))
    elif command == "build":
        side["build"](first, Path(second))
    else:
        side["logits"](Path(first), Path(second))
"""


def run(command: str, *pairs: str | Path) -> None:
    done = subprocess.run(
        [str(HF_PYTHON), "-c", _EACH_PAIR, str(TRANSFORMERS_SIDE), command, *map(str, pairs)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]


def build_all(root: Path) -> None:
    """Every family's tiny random model, and the rotary and routing references, under
    `root/<architecture>` (`root/references`), by one run of the transformers side."""
    root.mkdir(parents=True)
    run("build", *(arg for arch in (*MOE, *DENSE, "references") for arg in (arch, root / arch)))
