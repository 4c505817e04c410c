"""The model factory: the built-in byte GPT unchanged, Hugging Face causal LMs from a config.json (seeded init
or weights), tied embeddings and fragments, and one-line errors for bad model directories. Offline."""

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from p2p_diloco.config import ConfigError, ModelConfig, load_learner_config
from p2p_diloco.core.fragments import build_fragments
from p2p_diloco.core.outer import GlobalState
from p2p_diloco.train.models import gpt as byte_gpt
from p2p_diloco.train.models.registry import build_model, model_config_json, named_shapes, vocab_size

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "peers" / "models" / "llama-tiny"


def _tiny(seed: int = 0, **fields) -> torch.nn.Module:
    return build_model(ModelConfig(path=str(TINY), seq_len=64, **fields), seed)


def _sha(model: torch.nn.Module) -> str:
    return GlobalState.from_module(model).sha256()


def _config_dir(tmp_path: Path, **changes) -> Path:
    """A copy of llama-tiny's config.json with ``changes``, in its own directory."""
    raw = json.loads((TINY / "config.json").read_text())
    raw.update(changes)
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(raw))
    return d


def test_builtin_model_is_unchanged():
    # Hashes of the built-in model's Θ₀ before the factory existed: learners of old and new code still meet.
    assert _sha(build_model(ModelConfig(), 7)) == "780a5fb1bebe6b343fdd9b5cc4a5fd3b18c8afd8ebf0451a7685b7e9bfe8f6e8"
    cfg = load_learner_config(ROOT / "peers" / "default.toml").model
    assert _sha(build_model(cfg, 0)) == "d6d529357d87d1f4ac4cc8f33421ed33bd4be610a2883c372c3829f9284c6de6"
    model = build_model(ModelConfig(), 0)
    assert isinstance(model, byte_gpt.ByteGPT) and vocab_size(model) == 256 and model_config_json(model) is None


def test_hf_init_is_fixed_by_the_seed_and_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    a = _tiny(0)
    assert torch.equal(torch.rand(3), expected)
    assert _sha(a) == _sha(_tiny(0)) != _sha(_tiny(1))
    assert vocab_size(a) == 4096
    assert all(p.dtype == torch.float32 for p in a.parameters())


def test_hf_forward_takes_shifted_targets():
    model = _tiny(0).eval()
    x = torch.randint(0, 4096, (2, 17), generator=torch.Generator().manual_seed(0))
    logits, loss = model(x[:, :-1], x[:, 1:])
    assert logits.shape == (2, 16, 4096)
    assert torch.allclose(loss, F.cross_entropy(logits.reshape(-1, 4096), x[:, 1:].reshape(-1)))
    # transformers' own loss shifts unshifted labels once: the same number, so nothing is shifted twice.
    assert torch.allclose(loss, model.hf(input_ids=x, labels=x).loss, atol=1e-5)
    assert model(x)[1] is None


@pytest.mark.parametrize("shard", [None, "200KB"])
def test_weights_in_the_directory_are_loaded(tmp_path, shard):
    trained = _tiny(5).hf
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.5)  # far from any seeded init
    kwargs = {} if shard is None else {"max_shard_size": shard}
    trained.save_pretrained(tmp_path, **kwargs)
    assert (tmp_path / ("model.safetensors" if shard is None else "model.safetensors.index.json")).is_file()
    loaded = build_model(ModelConfig(path=str(tmp_path), seq_len=64), seed=0)
    assert all(torch.equal(a, b) for a, b in zip(loaded.parameters(), trained.parameters(), strict=True))
    assert loaded.hf.lm_head.weight is loaded.hf.model.embed_tokens.weight


def test_tied_embedding_is_one_tensor_of_one_fragment():
    model = _tiny(0)
    names = [n for n, _ in named_shapes(model)]
    # The tied lm_head is the embedding's Parameter: named_parameters() yields it once, under the embedding.
    assert model.hf.lm_head.weight is model.hf.model.embed_tokens.weight
    assert "hf.lm_head.weight" not in names and "hf.model.embed_tokens.weight" in names
    assert len(names) == len(list(model.parameters())) == len(GlobalState.from_module(model).params)
    fragments = build_fragments(named_shapes(model), 3, 30)
    assert sorted(i for f in fragments for i in f.tensor_indices) == list(range(len(names)))
    assert sum(f.numel for f in fragments) == sum(p.numel() for p in model.parameters())
    assert [f.has_embedding for f in fragments].count(True) == 1


def test_untied_head_is_its_own_tensor(tmp_path):
    model = build_model(ModelConfig(path=str(_config_dir(tmp_path, tie_word_embeddings=False)), seq_len=64), 0)
    names = [n for n, _ in named_shapes(model)]
    assert "hf.lm_head.weight" in names and len(names) == len(list(_tiny(0).parameters())) + 1


def test_activation_checkpointing_gives_the_same_gradients():
    x = torch.randint(0, 4096, (2, 9), generator=torch.Generator().manual_seed(1))
    grads = []
    for on in (False, True):
        model = _tiny(0, activation_checkpointing=on).train()
        model(x[:, :-1], x[:, 1:])[1].backward()
        assert getattr(model.hf, "is_activation_checkpointing", None) in (on, None)  # transformers 5 name
        assert any(getattr(m, "gradient_checkpointing", False) for m in model.hf.modules()) == on
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(*grads, strict=True))


def test_another_architecture(tmp_path):
    d = tmp_path / "gpt2"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 300, "n_embd": 32, "n_layer": 1,
                                               "n_head": 2, "n_positions": 64}))
    model = build_model(ModelConfig(path=str(d), seq_len=64), 0)
    x = torch.randint(0, 300, (1, 9))
    assert model(x[:, :-1], x[:, 1:])[0].shape == (1, 8, 300) and vocab_size(model) == 300
    with pytest.raises(ConfigError, match="exceeds max_position_embeddings"):
        build_model(ModelConfig(path=str(d), seq_len=128), 0)


def _bad_dirs(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    cases = {}

    def case(name: str, config: str | bytes | None, match: str) -> None:
        d = tmp_path / name
        d.mkdir()
        if isinstance(config, bytes):
            (d / "config.json").write_bytes(config)
        elif config is not None:
            (d / "config.json").write_text(config)
        cases[name] = (d, match)

    cases["not a directory"] = (tmp_path / "nowhere", "is not a directory")
    case("no config.json", None, "holds no config.json")
    case("not json", "{model_type: llama", "is not valid JSON")
    case("not utf-8", b"\xff\xfe{", "is not valid JSON")
    case("not an object", "[1, 2]", "is not a JSON object")
    case("no model_type", '{"vocab_size": 10}', "has no model_type")
    case("unknown architecture", '{"model_type": "no-such-llm"}', "does not know")
    case("not a causal lm", '{"model_type": "vit"}', "is not a causal language model")
    case("bad field", '{"model_type": "llama", "hidden_size": 64, "num_attention_heads": "many"}',
         "is not a valid llama config")
    unreadable = tmp_path / "unreadable"
    (unreadable / "config.json").mkdir(parents=True)  # a directory where the file should be (we may run as root)
    cases["unreadable"] = (unreadable, "cannot read")
    corrupt = _config_dir(tmp_path)
    (corrupt / "model.safetensors").write_bytes(b"not safetensors at all")
    cases["corrupt weights"] = (corrupt, "cannot load the weights")
    return cases


def test_each_bad_model_directory_is_one_line(tmp_path):
    for name, (path, match) in _bad_dirs(tmp_path).items():
        with pytest.raises(ConfigError, match=match) as info:
            build_model(ModelConfig(path=str(path), seq_len=64), 0)
        assert "\n" not in str(info.value), name
        assert len(str(info.value)) < 400, name


def test_config_json_names_the_model_not_its_path(tmp_path):
    moved = tmp_path / "elsewhere"
    shutil.copytree(TINY, moved)
    here, there = _tiny(0), build_model(ModelConfig(path=str(moved), seq_len=64), 0)
    assert model_config_json(here) == model_config_json(there) is not None
    assert json.loads(model_config_json(here))["hidden_size"] == 64


def test_embedding_tables_are_found_by_module_type_not_by_name():
    from p2p_diloco.core.fragments import build_fragments
    from p2p_diloco.train.models.registry import embedding_names

    class GPT2Like(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = torch.nn.Embedding(10, 4), torch.nn.Embedding(8, 4)
            self.proj = torch.nn.Linear(4, 4)

    model = GPT2Like()
    assert embedding_names(model) == {"wte.weight", "wpe.weight"}
    shapes = [(n, p.shape) for n, p in model.named_parameters()]
    frags = build_fragments(shapes, 3, 30, embedding_names(model))
    by_name = {shapes[i][0]: f.has_embedding for f in frags for i in f.tensor_indices}
    assert by_name["wte.weight"] and by_name["wpe.weight"] and not by_name["proj.weight"]
    assert not any(f.has_embedding for f in build_fragments(shapes, 3, 30))  # by name alone: missed
