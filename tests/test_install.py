"""What a fresh install promises: the packages import without Triton (the reference path on CPU, a
clear error where a kernel is asked for), versions, console scripts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import dta_fast
import dta_ref

ROOT = Path(__file__).resolve().parents[1]


def run_without_triton(code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter in which ``import triton`` fails, as where Triton is not installed."""
    prelude = "import sys; sys.modules['triton'] = None\n"
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", prelude + code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


def test_dta_fast_runs_the_reference_without_triton():
    """Without Triton, dta_fast imports, scores and trains on CPU through the reference attention; asking
    for the kernel raises an ImportError that names the extra to install."""
    code = """
import torch, dta_fast, dta_ref
from dta_ref import PrefixTree, SFTLoss
assert 'triton' not in [m for m, v in sys.modules.items() if v is not None]
model = dta_ref.Decoder(dta_ref.DecoderConfig(vocab_size=16, hidden_size=16, num_layers=1, num_heads=2,
                                              num_kv_heads=1, intermediate_size=32)).double()
tree = PrefixTree.from_sequences([[1, 2, 3, 4], [1, 2, 5]])
fast = dta_fast.tree_logprobs(model, tree)
torch.testing.assert_close(fast, dta_ref.tree_logprobs(model, tree))
dta_fast.tree_backward(model, tree, SFTLoss(tree.logprob_mask))
for ask in (lambda: dta_fast.tree_attention, lambda: dta_fast.tree_logprobs(model, tree, attention_impl="kernel")):
    try:
        ask()
    except ImportError as error:
        assert "dta-prefix-tree[fast]" in str(error), error
    else:
        raise AssertionError("no ImportError")
print("ok")
"""
    done = run_without_triton(code)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_versions_and_console_scripts():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert dta_ref.__version__ == dta_fast.__version__ and dta_ref.__version__.count(".") == 2
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License")
    for name, target in project["scripts"].items():
        module, function = target.split(":")
        assert callable(getattr(__import__(module, fromlist=[function]), function)), name
