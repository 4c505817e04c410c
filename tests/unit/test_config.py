from pathlib import Path

import pytest

from p2p_diloco.bootstrap import load_bootstrap_config
from p2p_diloco.config import ConfigError, load_learner_config
from p2p_diloco.errors import LearnerError, UserError

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["default.toml", "small-cpu.toml"])
def test_shipped_peer_configs_validate(name):
    cfg = load_learner_config(ROOT / "peers" / name)
    assert cfg.outer.lr == 0.7 and cfg.outer.momentum == 0.9


def test_overrides_are_typed_and_dotted():
    cfg = load_learner_config(None, ["inner.lr=3e-4", "averaging.compression=fp16",
                                     'network.initial_peers=["/ip4/1.2.3.4/tcp/5/p2p/X"]', "run.resume=true"])
    assert cfg.inner.lr == 3e-4 and cfg.averaging.compression == "fp16"
    assert cfg.network.initial_peers == ["/ip4/1.2.3.4/tcp/5/p2p/X"] and cfg.run.resume is True


@pytest.mark.parametrize("override, field", [
    ("inner.lr=-1", "inner.lr"),
    ("model.n_embd=65", "model"),
    ("averaging.compression=int3", "averaging.compression"),
    ("inner.nope=1", "inner.nope"),
    ("averaging.request_timeout=9", "averaging"),
    ("data.shard_index=20", "data"),
    ("run.eval_every=0", "run.eval_every"),
])
def test_bad_values_name_the_field_in_one_line(override, field):
    with pytest.raises(ConfigError) as e:
        load_learner_config(None, [override])
    msg = str(e.value)
    assert msg.startswith(field) and "\n" not in msg


def test_missing_and_broken_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_learner_config(tmp_path / "none.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[inner\nlr=")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_learner_config(bad)
    with pytest.raises(ConfigError, match="expected section.field=value"):
        load_learner_config(None, ["inner.lr"])


def test_bootstrap_config_errors_are_formatted_like_the_learners():
    with pytest.raises(ConfigError) as e:
        load_bootstrap_config(None, {"refresh_period": -1, "startup_timeout": 0, "maddrs_file": None})
    assert str(e.value) == "refresh_period: Input should be greater than 0 (and 1 more)"
    with pytest.raises(ConfigError, match="^nope: Extra inputs are not permitted$"):
        load_bootstrap_config(None, {"nope": 1})


def test_every_user_error_is_one_type_the_cli_catches():
    from p2p_diloco.train.checkpoint import CheckpointError
    from p2p_diloco.train.data.batches import DataError

    for cls in (ConfigError, DataError, CheckpointError, LearnerError):
        assert issubclass(cls, UserError), cls
    assert issubclass(LearnerError, RuntimeError) and issubclass(ConfigError, ValueError)
