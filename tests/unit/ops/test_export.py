"""``p2p-diloco export``: a checkpoint's global model Θ (not the local weights) in Hugging Face format with its
tokenizer, or as a torch state dict for the built-in model; one line for each bad input. Offline.

A checkpoint directory carries copies of its model's config.json and its tokenizer, so an export needs nothing
else; older checkpoints fall back to the paths in their config."""

import shutil
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer

from p2p_diloco.cli import main
from p2p_diloco.config import ModelConfig, load_learner_config
from p2p_diloco.learner.startup import build
from p2p_diloco.ops.export import ExportError, export
from p2p_diloco.train.checkpoint import FORMAT, CheckpointError, save_checkpoint, save_model_files
from p2p_diloco.train.data.tokenizer import load_tokenizer
from p2p_diloco.train.models.gpt import ByteGPT
from tests.unit.train.test_tokenizer import tiny_sentencepiece

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "peers" / "models" / "llama-tiny"
BPE = ROOT / "peers" / "tokenizers" / "bpe-4k"


def _checkpoint(directory: Path, *overrides: str, model_files: bool = False) -> list[torch.Tensor]:
    """A checkpoint as Learner.checkpoint writes it, after Θ and the local θ have moved apart; returns Θ.
    ``model_files``: with the copies of the model's config and tokenizer a learner keeps beside it (older
    checkpoints lack them)."""
    cfg = load_learner_config(ROOT / "peers" / "small-cpu.toml", ["inner.steps_per_outer=6", *overrides])
    if model_files:  # as startup does once it holds the directory
        save_model_files(directory, cfg.model.path, load_tokenizer(cfg.data.tokenizer).path)
    trainer, state = build(cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for s in state.states:  # "rounds" moved Θ ...
            for t in s.params:
                t.add_(0.01 * torch.randn(t.shape, generator=g))
            s.version = 3
        for p in trainer.model.parameters():  # ... and the local model trained on elsewhere
            p.add_(0.01 * torch.randn(p.shape, generator=g))
    save_checkpoint(directory, {
        "format": FORMAT, "config": cfg.model_dump(), "global": [s.to_dict() for s in state.states],
        "unconfirmed": [], "model": trainer.model.state_dict(), "inner_opt": trainer.inner_opt.state_dict(),
        "counters": vars(state.counters).copy(), "sampler_cursor": 0, "lr_position": trainer.lr_position.state(),
    })
    return [t.clone() for t in state.global_params()]


def _tokenizer_json(path: Path) -> Path:
    """A small byte-level BPE, trained in milliseconds, standing in for peers/tokenizers/bpe-4k."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["def f(x):\n    return x + 1\n"] * 20,
                            trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path))
    return path


def test_hf_export_loads_generates_and_holds_theta(tmp_path):
    tokenizer = _tokenizer_json(tmp_path / "tokenizer.json")
    theta = _checkpoint(tmp_path / "ckpt", f'model.path="{TINY}"', "sync.fragments=3", f'data.tokenizer="{tokenizer}"')
    out = export(tmp_path / "ckpt", tmp_path / "out")
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()

    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied: one tensor of Θ
    exported = list(model.parameters())
    assert len(exported) == len(theta) and all(torch.equal(a, b) for a, b in zip(exported, theta, strict=True))

    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    prompt = torch.tensor([tok.encode("def f(x):")])
    generated = model.generate(prompt, max_new_tokens=5, do_sample=False)
    assert generated.shape == (1, prompt.shape[1] + 5)
    assert isinstance(tok.decode(generated[0]), str)


def test_export_needs_only_the_checkpoint_directory(tmp_path, monkeypatch):
    """The learner ran elsewhere with relative paths, and its model and tokenizer directories are gone."""
    run = tmp_path / "run"
    shutil.copytree(TINY, run / "models" / "tiny")
    shutil.copytree(BPE, run / "tok")
    monkeypatch.chdir(run)
    theta = _checkpoint(Path("ckpt"), 'model.path="models/tiny"', 'data.tokenizer="tok"', model_files=True)
    assert sorted(str(p.relative_to("ckpt")) for p in Path("ckpt").rglob("*") if p.is_file()) == [
        "latest.pt", "model/config.json", "tokenizer/tokenizer.json"]  # no weights: Θ is in latest.pt
    shutil.rmtree(run / "models")
    shutil.rmtree(run / "tok")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main(["export", "--checkpoint-dir", str(run / "ckpt"), "--out", "out"]) == 0

    model = AutoModelForCausalLM.from_pretrained(elsewhere / "out", local_files_only=True)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), theta, strict=True))
    tok = AutoTokenizer.from_pretrained(elsewhere / "out", local_files_only=True)
    assert (tok.eos_token, tok.eos_token_id, model.generation_config.eos_token_id) == ("<|endoftext|>", 0, 0)
    prompt = torch.tensor([tok.encode("def f(x):")])
    # Pushed to <|endoftext|> at once, generate stops there: the export tells it which token ends a text.
    stopped = model.generate(prompt, max_new_tokens=5, do_sample=False, sequence_bias={(0,): 100.0})
    assert stopped[0, prompt.shape[1]:].tolist() == [0]


def test_old_checkpoints_use_the_paths_in_their_config_or_say_what_is_missing(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    shutil.copytree(TINY, run / "tiny")
    shutil.copytree(BPE, run / "tok")
    monkeypatch.chdir(run)
    _checkpoint(run / "ckpt", 'model.path="tiny"', 'data.tokenizer="tok"')  # no copies: written before them
    export(run / "ckpt", tmp_path / "o1")  # run where the learner ran: the relative paths resolve
    assert (tmp_path / "o1" / "tokenizer.json").is_file()

    monkeypatch.chdir(tmp_path)  # elsewhere: neither the copies nor the paths
    with pytest.raises(CheckpointError, match="holds no model/config.json, nor is there one in its model.path tiny"):
        export(run / "ckpt", tmp_path / "o2")
    (run / "ckpt" / "model").mkdir()
    shutil.copyfile(TINY / "config.json", run / "ckpt" / "model" / "config.json")  # as the message suggests
    capsys.readouterr()
    assert main(["export", "--checkpoint-dir", str(run / "ckpt"), "--out", str(tmp_path / "o3")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "holds no tokenizer/tokenizer.json" in err and len(err.splitlines()) == 1


def test_model_files_are_written_once_and_follow_the_tokenizer(tmp_path):
    ckpt = tmp_path / "ckpt"
    save_model_files(ckpt, str(TINY), BPE / "tokenizer.json")
    copies = [ckpt / "model" / "config.json", ckpt / "tokenizer" / "tokenizer.json"]
    assert [p.read_bytes() for p in copies] == [(TINY / "config.json").read_bytes(),
                                                (BPE / "tokenizer.json").read_bytes()]
    before = [p.stat().st_mtime_ns for p in copies]
    save_model_files(ckpt, str(TINY), BPE / "tokenizer.json")  # a resume: nothing rewritten
    assert [p.stat().st_mtime_ns for p in copies] == before
    spm = tiny_sentencepiece(tmp_path / "sp.model")
    save_model_files(ckpt, str(TINY), spm)  # the directory reused with another tokenizer: no stale copy
    assert sorted(p.name for p in (ckpt / "tokenizer").iterdir()) == ["tokenizer.model"]
    save_model_files(tmp_path / "bytes", None, None)  # the built-in model on bytes: nothing to copy
    assert not (tmp_path / "bytes").exists()
    assert not list(ckpt.rglob(".*tmp*"))


def test_builtin_export_is_a_state_dict_and_config(tmp_path):
    theta = _checkpoint(tmp_path / "ckpt", "sync.fragments=2")
    out = export(tmp_path / "ckpt", tmp_path / "out")
    model = ByteGPT(ModelConfig.model_validate_json((out / "config.json").read_text()))
    model.load_state_dict(torch.load(out / "model.pt", weights_only=True))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), theta, strict=True))


def test_sentencepiece_model_is_copied(tmp_path):
    import sentencepiece

    spm = tiny_sentencepiece(tmp_path / "sp.model")
    _checkpoint(tmp_path / "ckpt", f'model.path="{TINY}"', f'data.tokenizer="{spm}"')
    out = export(tmp_path / "ckpt", tmp_path / "out")
    assert (out / "tokenizer.model").read_bytes() == spm.read_bytes()
    assert sentencepiece.SentencePieceProcessor(model_file=str(out / "tokenizer.model")).get_piece_size() == 100


def test_bad_input_is_one_line(tmp_path, capsys):
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "latest.pt").write_bytes(b"not a checkpoint")
    good = tmp_path / "good"
    _checkpoint(good)
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    cases = [
        (tmp_path / "empty", tmp_path / "o1", CheckpointError, "no checkpoint in"),
        (corrupt, tmp_path / "o2", CheckpointError, "corrupt or unreadable"),
        (good, a_file, ExportError, "cannot write the export"),
        (good, a_file / "below", ExportError, "cannot write the export"),
    ]
    for ckpt, out, error, match in cases:
        with pytest.raises(error, match=match):
            export(ckpt, out)
        capsys.readouterr()
        assert main(["export", "--checkpoint-dir", str(ckpt), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err


def test_checkpoint_of_another_fragmentation_is_refused(tmp_path):
    _checkpoint(tmp_path / "ckpt", "sync.fragments=2")
    payload = torch.load(tmp_path / "ckpt" / "latest.pt", weights_only=True)
    payload["global"] = payload["global"][:1]
    save_checkpoint(tmp_path / "ckpt", payload)
    with pytest.raises(CheckpointError, match="does not fit its model"):
        export(tmp_path / "ckpt", tmp_path / "out")


