"""The M3 image processor and prompts with images: sizes, patch layout, limits, and the marks."""

import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

from tensorrt_llm._torch.models.modeling_minimaxm3_vision import (
    MiniMaxM3VisionConfig,
    vision_positions,
)
from tensorrt_llm.inputs.image_processing import (
    ImageProcessorConfig,
    MiniMaxM3ImageProcessor,
    load_image,
    smart_resize,
)
from tensorrt_llm.inputs.multimodal_prompts import IMAGE_TOKEN, VISION_START, MultimodalPrompts

IMAGE_ID = 9
VISION = MiniMaxM3VisionConfig(
    hidden_size=24, num_attention_heads=2, patch_size=4, image_token_id=IMAGE_ID
)


def picture(seed: int, height: int, width: int) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, 255, (height, width, 3), dtype=np.uint8)


def test_smart_resize_keeps_multiples_of_the_factor_within_the_pixel_bounds():
    assert smart_resize(224, 224, 28, 56 * 56, 28 * 28 * 1280) == (224, 224)
    assert smart_resize(100, 300, 28, 56 * 56, 28 * 28 * 1280) == (112, 308)
    assert smart_resize(10, 10, 28, 56 * 56, 10**6) == (56, 56)  # up to min_pixels
    h, w = smart_resize(2000, 3000, 28, 56 * 56, 28 * 28 * 256)  # down to max_pixels
    assert h % 28 == w % 28 == 0 and h * w <= 28 * 28 * 256 and abs(w / h - 1.5) < 0.1
    with pytest.raises(ValueError, match="aspect ratio above 200"):
        smart_resize(1, 201, 28, 1, 10**6)


def test_patches_are_block_major_with_the_temporal_copy():
    """Each patch row is (channel, temporal copy, row, column) of one 4x4 patch, patches ordered
    square by square as ``vision_positions`` places them."""
    processor = MiniMaxM3ImageProcessor(ImageProcessorConfig(patch_size=4, merge_size=2))
    x = torch.arange(3 * 16 * 24, dtype=torch.float32).view(3, 16, 24)
    patches, grid = processor.patchify(x)
    assert grid == (1, 4, 6) and patches.shape == (24, 3 * 2 * 4 * 4)
    positions = vision_positions([grid], 2)
    for row, (_, ph, pw) in zip(patches, positions.tolist(), strict=True):
        patch = row.view(3, 2, 4, 4)
        expected = x[:, 4 * ph : 4 * ph + 4, 4 * pw : 4 * pw + 4]
        assert torch.equal(patch[:, 0], expected) and torch.equal(patch[:, 1], expected)


def test_the_processor_normalizes_and_digests_by_pixels():
    processor = MiniMaxM3ImageProcessor(ImageProcessorConfig(patch_size=4, min_pixels=64))
    white = np.full((16, 16, 3), 255, dtype=np.uint8)
    item = processor(white)
    cfg = processor.config
    expected = (1.0 - torch.tensor(cfg.image_mean)) / torch.tensor(cfg.image_std)
    assert torch.allclose(item.patches.view(-1, 3, 32)[..., 0], expected.expand(16, 3))
    assert item.num_tokens == 4 and item.grid_thw == (1, 4, 4)
    as_png = io.BytesIO()
    Image.fromarray(white).save(as_png, format="PNG")
    assert processor(as_png.getvalue()).digest == item.digest  # the same pixels
    other = processor(picture(0, 16, 16))
    assert other.digest != item.digest and other.key_id != item.key_id < 0


def test_images_over_the_pixel_limit_or_not_images_are_refused():
    with pytest.raises(ValueError, match="image of 40x30 pixels: outside 1..1000 pixels"):
        load_image(picture(0, 30, 40), max_pixels=1000)
    with pytest.raises(ValueError, match="not a decodable image"):
        load_image(b"GIF89a but not really")
    with pytest.raises(TypeError, match="an image must be"):
        load_image(3.5)


class CharTokenizer:
    """Encodes IMAGE_TOKEN as IMAGE_ID, every other character as its code."""

    def encode(self, text: str) -> list[int]:
        out = []
        for i, piece in enumerate(text.split(IMAGE_TOKEN)):
            out += ([IMAGE_ID] if i else []) + [100 + ord(c) for c in piece]
        return out


@pytest.fixture
def prompts(tmp_path):
    """Images kept at their size (multiples of 8 pixels within 64..1024 pixels)."""
    size = {"shortest_edge": 64, "longest_edge": 1024}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"size": size}))
    return MultimodalPrompts(tmp_path, VISION, CharTokenizer(), max_images=2)


def test_marks_grow_to_each_images_tokens(prompts):
    a, b = picture(1, 16, 16), picture(2, 16, 32)  # 4 and 8 tokens
    ids = [1, IMAGE_ID, 2, IMAGE_ID, 3]
    got = prompts.prepare(ids, {"image": [a, b]})
    assert got.token_ids == [1] + [IMAGE_ID] * 4 + [2] + [IMAGE_ID] * 8 + [3]
    assert got.multimodal.offsets == [1, 6]
    again = prompts.prepare(got.token_ids, {"image": [a, b]})  # already expanded: kept
    assert again.token_ids == got.token_ids
    keys = got.multimodal.key_tokens(got.token_ids)
    assert keys[0] == 1 and len(set(keys[1:5])) == 1 and keys[1] < 0 and keys[6] != keys[1]
    text = prompts.prepare(f"x{IMAGE_TOKEN}y", {"image": a})
    assert text.token_ids.count(IMAGE_ID) == 4
    assert text.multimodal.offsets == [len("x" + VISION_START)]  # bracketed as transformers does


@pytest.mark.parametrize(
    ("prompt", "images", "message"),
    [
        ([1, IMAGE_ID, 2], 2, "1 runs of image_token_id=9 for 2 images"),
        ([1, IMAGE_ID, IMAGE_ID, 2], 1, "2 image tokens; expected 1 or the image's 4"),
        (f"a{IMAGE_TOKEN}b{IMAGE_TOKEN}", 1, "2 ']<]image[>[' marks for 1 images"),
        ([1, IMAGE_ID, IMAGE_ID, IMAGE_ID], 3, "3 images in one prompt; at most 2"),
    ],
)
def test_marks_that_do_not_match_the_images_are_refused(prompts, prompt, images, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        prompts.prepare(prompt, {"image": [picture(i, 16, 16) for i in range(images)]})


def test_a_model_without_a_vision_tower_refuses_images(tmp_path):
    with pytest.raises(ValueError, match="no vision tower"):
        MultimodalPrompts(tmp_path, None).prepare([1], {"image": [picture(0, 8, 8)]})
    with pytest.raises(ValueError, match=r"\['video'\] not served"):
        MultimodalPrompts(tmp_path, None).prepare([1], {"video": []})


def test_images_cross_ranks_as_pixels_and_give_the_same_patches(prompts):
    """What a follower rank gets (JSON: base64 pixels, the processor settings) makes the same
    patches and digest; an image known only by digest crosses as such."""
    from tensorrt_llm._torch.pyexecutor.multimodal import ImageItem, MultimodalInput
    from tensorrt_llm.inputs.image_processing import images_from_json, images_to_json

    image = prompts.processor(picture(5, 24, 40))
    known = ImageItem.known("ab" * 32, 3)
    wire = json.loads(json.dumps(images_to_json(MultimodalInput([image, known], [2, 40]))))
    got = images_from_json(wire)
    assert got.offsets == [2, 40]
    assert torch.equal(got.images[0].patches, image.patches)
    assert (got.images[0].digest, got.images[0].grid_thw) == (image.digest, image.grid_thw)
    assert got.images[1] == known
    wire[0]["digest"] = "cd" * 32
    with pytest.raises(RuntimeError, match="patches differ between ranks"):
        images_from_json(wire)


@pytest.mark.parametrize(
    ("height", "width"), [(16, 16), (30, 40), (333, 517), (1200, 90), (56, 56)]
)
def test_the_processor_gives_transformers_patches(height, width):
    """Against transformers' ``MiniMaxM3VLImageProcessor`` (which needs torchvision: where it is
    missing, as on the CPU CI machine, this is skipped; the patch layout and the arithmetic are
    pinned by the tests above)."""
    pytest.importorskip("torchvision")
    transformers = pytest.importorskip("transformers", minversion="5.24")
    size = {"shortest_edge": 64, "longest_edge": 64 * 64}
    theirs = transformers.MiniMaxM3VLImageProcessor(size=size, patch_size=4)
    ours = MiniMaxM3ImageProcessor(
        ImageProcessorConfig(patch_size=4, min_pixels=64, max_pixels=64 * 64)
    )
    image = Image.fromarray(picture(7, height, width))
    want = theirs(images=[image], return_tensors="pt")
    got = ours(image)
    assert list(want["image_grid_thw"][0]) == list(got.grid_thw)
    torch.testing.assert_close(got.patches, want["pixel_values"], rtol=0, atol=1e-6)
