"""Prompts with images: upstream's ``{"prompt": ..., "multi_modal_data": {"image": [...]}}``.

Each image is marked in the prompt once, and the mark grows to the image's token count:

- text: ``]<]image[>[`` (``IMAGE_TOKEN``) becomes ``]<]start of image[>[`` + ``IMAGE_TOKEN`` x n +
  ``]<]end of image[>[``, as transformers' ``MiniMaxM3VLProcessor`` writes it, then the text is
  tokenized;
- token ids: a lone ``image_token_id`` becomes n of them; a run of exactly n is taken as it is
  (already expanded). Any other run length is an error.

The i-th mark takes the i-th image; a count that differs from the images given is an error.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tensorrt_llm._torch.models.modeling_minimaxm3_vision import MiniMaxM3VisionConfig
from tensorrt_llm._torch.pyexecutor.multimodal import ImageItem, MultimodalInput
from tensorrt_llm.inputs.image_processing import ImageProcessorConfig, MiniMaxM3ImageProcessor

IMAGE_TOKEN = "]<]image[>["
VISION_START = "]<]start of image[>["
VISION_END = "]<]end of image[>["
MAX_IMAGES_PER_PROMPT = 16


@dataclass(frozen=True)
class MultimodalPrompt:
    text: str | None
    token_ids: list[int]
    multimodal: MultimodalInput | None


class MultimodalPrompts:
    """Turns a prompt and its images into token ids and the request's ``MultimodalInput``."""

    def __init__(
        self,
        model_dir: str | Path,
        vision: MiniMaxM3VisionConfig | None,
        tokenizer=None,
        max_images: int = MAX_IMAGES_PER_PROMPT,
    ) -> None:
        self.vision = vision
        self.tokenizer = tokenizer
        self.max_images = max_images
        self.processor = (
            None
            if vision is None
            else MiniMaxM3ImageProcessor(ImageProcessorConfig.from_pretrained(model_dir, vision))
        )

    def images(self, data: Any) -> list[Any]:
        """The images of a ``multi_modal_data`` value (``{"image": one or a list}``)."""
        if not isinstance(data, dict):
            raise TypeError(f"multi_modal_data must be a dict, got {type(data).__name__}")
        unknown = sorted(set(data) - {"image"})
        if unknown:
            raise ValueError(f"multi_modal_data: {unknown} not served; only 'image' is")
        images = data.get("image")
        if images is None:
            return []
        return list(images) if isinstance(images, list | tuple) else [images]

    def prepare(self, prompt: str | list[int], multi_modal_data: Any) -> MultimodalPrompt:
        sources = self.images(multi_modal_data)
        if not sources:
            return MultimodalPrompt(None, [], None)  # the caller tokenizes as usual
        if self.vision is None:
            raise ValueError("this model has no vision tower (its config has no vision_config)")
        if len(sources) > self.max_images:
            raise ValueError(f"{len(sources)} images in one prompt; at most {self.max_images}")
        items = []
        for i, source in enumerate(sources):
            if isinstance(source, ImageItem):  # processed already (the server's)
                items.append(source)
                continue
            try:
                items.append(self.processor(source))
            except (ValueError, TypeError) as exc:
                raise type(exc)(f"multi_modal_data image {i}: {exc}") from None
        if isinstance(prompt, str):
            text, token_ids = prompt, self._tokenize(prompt, items)
        else:
            text, token_ids = None, self._expand_ids(list(prompt), items)
        offsets = self._offsets(token_ids, items)
        return MultimodalPrompt(text, token_ids, MultimodalInput(items, offsets))

    def _tokenize(self, prompt: str, items: list[ImageItem]) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("skip_tokenizer_init=True: prompts with images must be token ids")
        pieces = prompt.split(IMAGE_TOKEN)
        if len(pieces) - 1 != len(items):
            raise ValueError(
                f"the prompt has {len(pieces) - 1} {IMAGE_TOKEN!r} marks for {len(items)} images"
            )
        text = pieces[0]
        for item, piece in zip(items, pieces[1:], strict=True):
            text += VISION_START + IMAGE_TOKEN * item.num_tokens + VISION_END + piece
        return self.tokenizer.encode(text)

    def _expand_ids(self, ids: list[int], items: list[ImageItem]) -> list[int]:
        runs = _runs(ids, self.vision.image_token_id)
        if len(runs) != len(items):
            raise ValueError(
                f"the prompt has {len(runs)} runs of image_token_id={self.vision.image_token_id} "
                f"for {len(items)} images"
            )
        out, at = [], 0
        for (start, length), item in zip(runs, items, strict=True):
            if length not in (1, item.num_tokens):
                raise ValueError(
                    f"image at prompt position {start}: {length} image tokens; expected 1 or "
                    f"the image's {item.num_tokens}"
                )
            out += ids[at:start] + [self.vision.image_token_id] * item.num_tokens
            at = start + length
        return out + ids[at:]

    def _offsets(self, ids: list[int], items: list[ImageItem]) -> list[int]:
        runs = _runs(ids, self.vision.image_token_id)
        lengths = [length for _, length in runs]
        if lengths != [item.num_tokens for item in items]:
            raise ValueError(
                f"the tokenized prompt has image runs of {lengths} tokens for images of "
                f"{[item.num_tokens for item in items]}: the tokenizer must encode "
                f"{IMAGE_TOKEN!r} as image_token_id={self.vision.image_token_id}"
            )
        return [start for start, _ in runs]


def _runs(ids: list[int], token: int) -> list[tuple[int, int]]:
    """``(start, length)`` of each maximal run of ``token`` in ``ids``."""
    runs: list[tuple[int, int]] = []
    for i, t in enumerate(ids):
        if t != token:
            continue
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs
