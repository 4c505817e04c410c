import pytest

from .harness import Swarm


@pytest.fixture
def swarm(tmp_path, request):
    s = Swarm(tmp_path)
    yield s
    failed = getattr(request.node, "rep_call", None)
    if failed is not None and failed.failed:
        print(s.describe())
    s.close()


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, f"rep_{rep.when}", rep)
