import pytest
from llm_helpers import write_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_m3"))


@pytest.fixture(scope="session")
def spec_checkpoints(tmp_path_factory):
    """A target with M3's 128-token MSA blocks (top-1 block plus the local one) and a drafter for it."""
    from llm_helpers import write_tiny_eagle3

    root = tmp_path_factory.mktemp("tiny_m3_eagle3")
    target = write_tiny_checkpoint(
        root / "target",
        max_position_embeddings=1024,
        sparse_attention_config={
            "index_n_heads": 2,
            "index_head_dim": 8,
            "topk_blocks": 1,
            "block_size": 128,
            "num_dense_layers": 1,
        },
    )
    return target, write_tiny_eagle3(root / "draft", target)
