"""A Hugging Face model with a real tokenizer on table data, through the whole swarm and out again:
three learners train the shipped tiny Llama with the committed BPE on a .jsonl corpus, end on one
global state with a falling eval loss, and the global model exported from a checkpoint loads with
transformers and generates."""

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from .harness import ROOT

LLAMA = str(ROOT / "peers" / "llama-tiny.toml")


def _jsonl_corpus(path: Path, rows: int = 400) -> Path:
    """Rows of Python standard-library source as {"text": ...}: a table corpus every machine has."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py") if p.stat().st_size > 2000)[:rows]
    with path.open("w") as f:
        for p in files:
            f.write(json.dumps({"id": p.name, "text": p.read_text(errors="replace")[:6000]}) + "\n")
    return path


@pytest.mark.timeout(480)
def test_three_learners_train_a_llama_on_jsonl_then_export_it(swarm, tmp_path):
    data = _jsonl_corpus(tmp_path / "corpus.jsonl")
    swarm.start_bootstrap()
    extra = ["--config", LLAMA, "--data", str(data), "--set", f"data.cache_dir={tmp_path / 'cache'}",
             "--set", "inner.batch_size=8"]
    learners = [swarm.start_learner(i, max_outer_steps=3, extra=extra) for i in range(3)]
    for p in learners:
        assert p.wait(400) == 0, p.text()
    summaries = [swarm.summary(i) for i in range(3)]
    assert len({s["global_state_sha256"] for s in summaries}) == 1, summaries
    assert all(s["version"] == 3 and s["last_eval_loss"] < s["first_eval_loss"] - 0.5 for s in summaries), summaries
    assert "tokens, eval split" in learners[0].text()  # token ids from the BPE, not bytes

    out = tmp_path / "exported"
    done = subprocess.run([sys.executable, "-m", "p2p_diloco", "export", "--checkpoint-dir",
                           str(tmp_path / "ckpt-0"), "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    from transformers import AutoModelForCausalLM

    from p2p_diloco.ops.export import global_model

    exported = AutoModelForCausalLM.from_pretrained(out)
    _, theta = global_model(tmp_path / "ckpt-0")
    for (name, p), q in zip(exported.named_parameters(), theta.hf.parameters(), strict=True):
        assert torch.equal(p, q), name
    prompt = torch.tensor([[1, 2, 3]])
    generated = exported.generate(prompt, max_new_tokens=5, do_sample=False)
    assert generated.shape == (1, 8)
