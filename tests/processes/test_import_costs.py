"""What a fresh interpreter imports on the light paths: the default data path loads no tokenizer or
dataset library, `export --help` no torch, a training step no torch._dynamo."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def corpus(tmp_path):
    g = torch.Generator().manual_seed(0)
    for i in range(60):
        (tmp_path / f"doc{i:02d}.txt").write_bytes(bytes(torch.randint(97, 123, (3000,), generator=g).tolist()))
    return tmp_path


LIBRARIES = ("tokenizers", "datasets", "sentencepiece", "transformers")


def test_the_default_path_imports_no_tokenizer_or_dataset_library(corpus):
    code = (f"import sys; from p2p_diloco.config import DataConfig; "
            f"from p2p_diloco.train.data.batches import load_splits; "
            f"load_splits(DataConfig(path={str(corpus)!r}, num_shards=3), [0, None]); "
            f"print(sorted(m for m in {LIBRARIES!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_export_help_stays_light():
    code = ("import sys; from p2p_diloco.cli import main\ntry: main(['export', '--help'])\nexcept SystemExit: pass\n"
            "print([m for m in ('torch', 'hivemind', 'transformers') if m in sys.modules])")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "--checkpoint-dir" in run.stdout and run.stdout.strip().endswith("[]"), run.stdout + run.stderr


def test_a_training_step_does_not_import_torch_dynamo():
    code = ("import sys, torch; from p2p_diloco.core.inner_optim import AdamW; m = torch.nn.Linear(3, 3); "
            "o = AdamW(m.parameters()); m(torch.ones(3)).sum().backward(); o.step(); "
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr
