import pytest
from m3_helpers import tiny_config

from tensorrt_llm._torch.models.checkpoint import random_model


@pytest.fixture
def tiny_model():
    cfg = tiny_config()
    return cfg, random_model(cfg, seed=0, std=0.1)
