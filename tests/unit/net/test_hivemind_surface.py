"""The private hivemind methods this package overrides are the ones it was checked against
(p2p_diloco/net/hivemind_surface.py): a new hivemind fails here, naming each method to read again."""

import hivemind
import pytest

from p2p_diloco.net import hivemind_surface
from p2p_diloco.net.hivemind_surface import OVERRIDES, PINNED_VERSION


def test_the_installed_hivemind_is_the_pinned_one():
    assert hivemind.__version__ == PINNED_VERSION
    constraints = (hivemind_surface.__file__.rsplit("/p2p_diloco/", 1)[0]) + "/constraints.txt"
    assert f"hivemind=={PINNED_VERSION}" in open(constraints).read()


@pytest.mark.parametrize("override", OVERRIDES, ids=lambda o: o.upstream.rsplit(":", 1)[1])
def test_each_overridden_method_is_unchanged_upstream(override):
    assert override.upstream_fingerprint() == override.fingerprint, (
        f"{override.upstream} changed upstream: read it, adapt p2p_diloco/net/{override.ours}.py, "
        "then update its fingerprint")


@pytest.mark.parametrize("override", OVERRIDES, ids=lambda o: o.upstream.rsplit(":", 1)[1])
def test_each_entry_names_the_module_that_overrides_it(override):
    source = open(f"{hivemind_surface.__file__.rsplit('/', 1)[0]}/{override.ours}.py").read()
    assert f"def {override.attribute}(" in source
