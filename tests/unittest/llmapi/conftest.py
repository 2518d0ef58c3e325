import pytest
from llm_helpers import write_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_m3"))


@pytest.fixture(scope="session")
def spec_checkpoints(tmp_path_factory):
    """A target with M3's 128-token index blocks (top-2: the local one and one more) and a drafter
    for it."""
    from llm_helpers import write_tiny_eagle3

    root = tmp_path_factory.mktemp("tiny_m3_eagle3")
    target = write_tiny_checkpoint(
        root / "target",
        max_position_embeddings=1024,
        index_block_size=128,
        index_topk_blocks=2,
    )
    return target, write_tiny_eagle3(root / "draft", target)
