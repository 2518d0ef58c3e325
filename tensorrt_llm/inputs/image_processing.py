"""MiniMax-M3's image processor (transformers' ``MiniMaxM3VLImageProcessor``), in torch alone.

An RGB image of ``H x W`` pixels becomes patches the vision tower reads::

    resize to (h, w): multiples of patch * merge, pixels within [min_pixels, max_pixels], the
        aspect ratio kept (``smart_resize``); bicubic with antialiasing on the 8-bit pixels
    rescale by 1/255 and normalize by the CLIP mean and std, in one step: (x - 255 mean) / (255 std)
    grid (1, h/patch, w/patch); patches block-major over merge x merge squares, each patch
        flattened as (channel, temporal copy, row, column): [gh * gw, C * T * P * P]

One image gives ``gh * gw / merge**2`` placeholder tokens. Settings come from the checkpoint's
``preprocessor_config.json`` when it has one, else transformers' defaults with the vision config's
patch and merge sizes.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import io
import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from tensorrt_llm._torch.models.modeling_minimaxm3_vision import MiniMaxM3VisionConfig
from tensorrt_llm._torch.pyexecutor.multimodal import ImageItem, MultimodalInput

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_DECODED_PIXELS = 64 * 1024 * 1024  # an image larger than this is refused before decoding
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")  # the decoders encoded images may reach
# The processor decodes at most this many times its max_pixels (at least MIN_DECODE_PIXELS): what
# it resizes away is never decoded (a JPEG at a reduced scale) or refused from the header.
DECODE_BUDGET = 64
MIN_DECODE_PIXELS = 4 * 1024 * 1024


@dataclass(frozen=True)
class ImageProcessorConfig:
    min_pixels: int = 4 * 28 * 28
    max_pixels: int = 451584
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, float, float] = CLIP_MEAN
    image_std: tuple[float, float, float] = CLIP_STD
    rescale_factor: float = 1 / 255

    @classmethod
    def from_pretrained(
        cls, model_dir: str | Path, vision: MiniMaxM3VisionConfig
    ) -> ImageProcessorConfig:
        kwargs: dict[str, Any] = {
            "patch_size": vision.patch_size,
            "temporal_patch_size": vision.temporal_patch_size,
            "merge_size": vision.spatial_merge_size,
        }
        path = Path(model_dir) / "preprocessor_config.json"
        if path.is_file():
            data = json.loads(path.read_text())
            size = data.get("size") or {}
            for key, value in (
                ("min_pixels", data.get("min_pixels", size.get("shortest_edge"))),
                ("max_pixels", data.get("max_pixels", size.get("longest_edge"))),
                ("image_mean", data.get("image_mean")),
                ("image_std", data.get("image_std")),
                ("rescale_factor", data.get("rescale_factor")),
            ):
                if value is not None:
                    kwargs[key] = tuple(value) if isinstance(value, list) else value
        return cls(**kwargs)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int):
    """``(h, w)``: multiples of ``factor`` near ``(height, width)``, ``h * w`` within the bounds."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"image of {width}x{height} pixels: aspect ratio above 200")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def load_image(source: Any, max_pixels: int = MAX_DECODED_PIXELS, fit=None):
    """A PIL RGB image from a PIL image, encoded bytes (PNG, JPEG, WebP, GIF or BMP), a path, or an
    ``[H, W, 3]`` uint8 array. Undecodable or oversized input is a ``ValueError`` saying so.

    Only the header is read before the size is checked against ``max_pixels``. ``fit(width,
    height) -> (width, height)``: the size the image will be resized to; a JPEG over
    ``max_pixels`` is then decoded at the smallest of its reduced scales that still covers that
    size (1/2, 1/4 or 1/8 per side), and refused only if even that is over."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(source, Image.Image):
        image = source
    elif isinstance(source, bytes | bytearray):
        try:
            with warnings.catch_warnings():  # (the size is checked below, against max_pixels)
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                image = Image.open(io.BytesIO(source), formats=IMAGE_FORMATS)
        except Image.DecompressionBombError as exc:
            raise ValueError(f"image over {max_pixels} pixels ({exc})") from None
        except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
            raise ValueError(f"not a decodable image ({exc})") from None
        except Exception as exc:  # a decoder's own error on bytes nobody vouched for
            raise ValueError(f"not a decodable image ({type(exc).__name__})") from None
    elif isinstance(source, str | Path):
        if not Path(source).is_file():
            raise ValueError(f"image file {str(source)!r} does not exist")
        return load_image(Path(source).read_bytes(), max_pixels, fit)
    elif hasattr(source, "shape") and len(source.shape) == 3 and source.shape[-1] == 3:
        image = Image.fromarray(torch.as_tensor(source).to(torch.uint8).numpy())
    else:
        raise TypeError(
            f"an image must be a PIL image, bytes, a path or an [H, W, 3] array, got "
            f"{type(source).__name__}"
        )
    width, height = image.size
    if width * height > max_pixels and fit is not None and image.format == "JPEG":
        image.draft("RGB", fit(width, height))  # decodes at a reduced scale from here on
    if image.size[0] * image.size[1] > max_pixels or min(image.size) < 1:
        raise ValueError(f"image of {width}x{height} pixels: outside 1..{max_pixels} pixels")
    try:
        return image.convert("RGB")
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise ValueError(f"not a decodable image ({exc})") from None
    except Exception as exc:  # (as above)
        raise ValueError(f"not a decodable image ({type(exc).__name__})") from None


class MiniMaxM3ImageProcessor:
    def __init__(self, config: ImageProcessorConfig) -> None:
        self.config = config

    def num_tokens(self, grid_thw: tuple[int, int, int]) -> int:
        return math.prod(grid_thw) // self.config.merge_size**2

    @property
    def max_decoded_pixels(self) -> int:
        budget = max(DECODE_BUDGET * self.config.max_pixels, MIN_DECODE_PIXELS)
        return min(MAX_DECODED_PIXELS, budget)

    def __call__(self, source: Any) -> ImageItem:
        cfg = self.config
        factor = cfg.patch_size * cfg.merge_size

        def fit(width: int, height: int) -> tuple[int, int]:
            h, w = smart_resize(height, width, factor, cfg.min_pixels, cfg.max_pixels)
            return w, h

        image = load_image(source, self.max_decoded_pixels, fit)
        pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
        pixels = pixels.view(image.size[1], image.size[0], 3).permute(2, 0, 1)  # [3, H, W]
        h, w = smart_resize(*pixels.shape[1:], factor, cfg.min_pixels, cfg.max_pixels)
        if (h, w) != tuple(pixels.shape[1:]):  # torch's 8-bit kernel, as torchvision resizes
            pixels = F.interpolate(pixels[None], size=(h, w), mode="bicubic", antialias=True)[0]
        return self.from_pixels(pixels.contiguous())

    def from_pixels(self, pixels: torch.Tensor) -> ImageItem:
        """The image of resized 8-bit ``pixels [3, H, W]`` (H and W multiples of patch * merge)."""
        cfg = self.config
        # the rescale folded into the mean and std, in fp32, as transformers' backend computes it
        mean = (torch.tensor(cfg.image_mean) * (1.0 / cfg.rescale_factor)).view(3, 1, 1)
        std = (torch.tensor(cfg.image_std) * (1.0 / cfg.rescale_factor)).view(3, 1, 1)
        patches, grid = self.patchify((pixels.float() - mean) / std)
        digest = hashlib.sha256(str(grid).encode() + patches.numpy().tobytes()).hexdigest()
        processing = dataclasses.asdict(cfg)
        return ImageItem(patches, grid, digest, self.num_tokens(grid), pixels, processing)

    def patchify(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """``[C, H, W]`` -> ``[gh * gw, C * T * P * P]`` block-major patches and the grid."""
        cfg = self.config
        p, m, t = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
        c, height, width = x.shape
        gh, gw = height // p, width // p
        x = x.reshape(c, gh // m, m, p, gw // m, m, p)
        x = x.permute(1, 4, 2, 5, 0, 3, 6)  # [gh/m, gw/m, m, m, C, P, P]
        x = x.unsqueeze(5).expand(-1, -1, -1, -1, -1, t, -1, -1)  # the temporal copies
        return x.reshape(gh * gw, c * t * p * p).contiguous(), (1, gh, gw)


def images_to_json(mm: MultimodalInput | None) -> list[dict] | None:
    """A request's images as another rank needs them: where they are, their digests, and (when
    this rank holds them) their resized pixels and processor settings, to make the same patches.
    The pixels travel as base64 bytes: a quarter of the patches' size, nothing to unpickle."""
    if mm is None:
        return None
    out = []
    for image, (offset, num_tokens, digest) in zip(mm.images, mm.refs(), strict=True):
        entry = {"offset": offset, "num_tokens": num_tokens, "digest": digest}
        if image.pixels is not None:
            entry["shape"] = list(image.pixels.shape)
            entry["pixels"] = base64.b64encode(image.pixels.numpy().tobytes()).decode()
            entry["processing"] = image.processing
        out.append(entry)
    return out


def images_from_json(entries: list[dict] | None) -> MultimodalInput | None:
    """``images_to_json``'s images, their patches made again from the pixels; a patch digest that
    differs from the sender's is an error (the ranks would see different images)."""
    if entries is None:
        return None
    images = []
    for entry in entries:
        if "pixels" not in entry:
            images.append(ImageItem.known(entry["digest"], entry["num_tokens"]))
            continue
        raw = bytearray(base64.b64decode(entry["pixels"]))
        pixels = torch.frombuffer(raw, dtype=torch.uint8).view(*entry["shape"])
        processing = {
            k: tuple(v) if isinstance(v, list) else v for k, v in entry["processing"].items()
        }
        image = MiniMaxM3ImageProcessor(ImageProcessorConfig(**processing)).from_pixels(pixels)
        if image.digest != entry["digest"]:
            raise RuntimeError(f"an image's patches differ between ranks ({entry['digest'][:12]})")
        images.append(image)
    return MultimodalInput(images, [entry["offset"] for entry in entries])
