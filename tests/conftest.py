import os

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings

# CI runs the property tests derandomized (the same examples every run) and reports a failure
# without shrinking it (shrinking a 40-step machine can take minutes); locally they explore and shrink.
settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)
settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else "dev")

# The test command runs two pytest-xdist workers on a 2-core machine: one torch thread each, so
# they do not fight over the cores (servers and ranks the tests start keep their own settings)
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
