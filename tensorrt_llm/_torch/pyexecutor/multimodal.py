"""A request's images as the engine sees them, and the encoder that turns them into embeddings.

A prompt holds each image as a run of ``num_tokens`` placeholder tokens (the model's
``image_token_id``) starting at ``offset``::

    prompt     t t t I I I I I I t t I I I t      I: image_token_id
    images          [0: offset 3, 6 tokens]  [1: offset 11, 3 tokens]
    key ids    t t t a a a a a a t t b b b t      a, b: each image's key id (< 0)

The KV cache keys blocks by the **key ids** (``MultimodalInput.key_tokens``): a placeholder is
replaced by a negative id drawn from its image's digest, so a block holding image tokens is reused
only for the same image, and the blocks after it only behind the same images.

``MultimodalEncoder`` runs the vision tower ahead of the prefill: each step, the images of the
scheduled context chunks that are not encoded yet go through the tower together, once per digest
(``EncoderCache`` keeps recent images' embeddings: ``n > 1`` samples and later turns reuse them);
``rows`` then says which rows of the step's token embeddings they replace.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

KEY_ID_BITS = 62


@dataclass(frozen=True)
class ImageItem:
    """One processed image: its patches (host, fp32), patch grid and content digest. A generation
    server resuming a disaggregated request knows only the digest and the token count (its KV
    comes from the context server; it never encodes the image): ``patches`` and ``grid_thw`` None.
    """

    patches: torch.Tensor | None  # [num_patches, C * T * P * P]
    grid_thw: tuple[int, int, int] | None
    digest: str  # sha256 hex of the grid and the patches: equal only for the same pixels
    num_tokens: int  # placeholder tokens it fills (patches / merge**2)
    # the resized 8-bit pixels [3, H, W] and the processor settings that made the patches from
    # them: what another rank needs to make the same patches (``executors/ranks.py``)
    pixels: torch.Tensor | None = None
    processing: dict | None = None

    @classmethod
    def known(cls, digest: str, num_tokens: int) -> ImageItem:
        """An image known by its digest and token count alone."""
        return cls(None, None, digest, num_tokens)

    @property
    def key_id(self) -> int:
        """The id its placeholders take in block keys: negative, so never a real token."""
        return -1 - (int(self.digest[:16], 16) >> (64 - KEY_ID_BITS))


@dataclass
class MultimodalInput:
    """A request's images, with where each one's placeholders start in the prompt."""

    images: list[ImageItem]
    offsets: list[int]
    # per image index: its embeddings [num_tokens, hidden] on the device, while its prompt is
    # prefilled (dropped after: the encoder cache may still hold them)
    features: dict[int, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def from_refs(cls, refs: list[tuple[int, int, str]]) -> MultimodalInput:
        """Images known by ``(offset, num_tokens, digest)`` alone (``ImageItem.known``)."""
        images = [ImageItem.known(digest, num_tokens) for _, num_tokens, digest in refs]
        return cls(images, [offset for offset, _, _ in refs])

    def refs(self) -> list[tuple[int, int, str]]:
        """``(offset, num_tokens, digest)`` of each image: all another server needs to key its
        blocks as this one does."""
        return [(o, i.num_tokens, i.digest) for i, o in zip(self.images, self.offsets, strict=True)]

    def key_tokens(self, prompt: list[int]) -> list[int]:
        keys = list(prompt)
        for image, offset in zip(self.images, self.offsets, strict=True):
            keys[offset : offset + image.num_tokens] = [image.key_id] * image.num_tokens
        return keys

    def spans(self, start: int, end: int) -> list[tuple[int, int, int]]:
        """``(image index, first, last)`` of the images' token ranges inside prompt ``[start,
        end)``: ``first``/``last`` count from the image's own first token (``last`` exclusive)."""
        out = []
        for i, (image, offset) in enumerate(zip(self.images, self.offsets, strict=True)):
            lo, hi = max(start, offset), min(end, offset + image.num_tokens)
            if lo < hi:
                out.append((i, lo - offset, hi - offset))
        return out


class EncoderCache:
    """Embeddings of recently encoded images by digest, least recently used dropped first once
    they hold more than ``max_tokens`` image tokens."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.num_tokens = 0
        self.num_hits = 0
        self.num_encoded = 0

    def get(self, digest: str) -> torch.Tensor | None:
        features = self._entries.get(digest)
        if features is not None:
            self._entries.move_to_end(digest)
            self.num_hits += 1
        return features

    def put(self, digest: str, features: torch.Tensor) -> None:
        self.num_encoded += 1
        if digest in self._entries or features.shape[0] > self.max_tokens:
            return
        self._entries[digest] = features
        self.num_tokens += features.shape[0]
        while self.num_tokens > self.max_tokens:
            _, dropped = self._entries.popitem(last=False)
            self.num_tokens -= dropped.shape[0]


class MultimodalEncoder:
    """Encodes a step's images with ``model.encode_images`` and places their embeddings."""

    def __init__(self, model: torch.nn.Module, device: torch.device, cache_tokens: int) -> None:
        self.model = model
        self.device = device
        self.cache = EncoderCache(cache_tokens)

    def prepare(self, context_requests: list) -> None:
        """Make sure every image a scheduled chunk (or a later chunk of the same prompt) needs
        has its embeddings on the request: from the cache, or encoded here, all of the step's
        new images in one call of the tower."""
        missing: dict[str, ImageItem] = {}
        waiting: list[tuple[MultimodalInput, int, str]] = []
        for req in context_requests:
            mm = req.multimodal
            if mm is None:
                continue
            for i, _, _ in mm.spans(req.context_current_position, req.prompt_len):
                if i in mm.features:
                    continue
                image = mm.images[i]
                cached = self.cache.get(image.digest)
                if cached is not None:
                    mm.features[i] = cached
                else:
                    missing.setdefault(image.digest, image)
                    waiting.append((mm, i, image.digest))
        if not missing:
            return
        images = list(missing.values())
        patches = torch.cat([im.patches for im in images]).to(self.device, non_blocking=True)
        with torch.inference_mode():
            features = self.model.encode_images(patches, [im.grid_thw for im in images])
        encoded = {}
        for image, feats in zip(images, features, strict=True):
            encoded[image.digest] = feats
            self.cache.put(image.digest, feats)
        for mm, i, digest in waiting:
            mm.features[i] = encoded[digest]

    def rows(self, context_requests: list) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(rows, embeddings)`` for the step's flat token rows that hold image tokens (context
        chunks come first in a step, in order). Drops a request's embeddings once its last chunk
        is in this step."""
        rows: list[torch.Tensor] = []
        parts: list[torch.Tensor] = []
        base = 0
        for req in context_requests:
            start, size = req.context_current_position, req.context_chunk_size
            mm = req.multimodal
            if mm is not None:
                for i, first, last in mm.spans(start, start + size):
                    at = base + mm.offsets[i] + first - start
                    rows.append(torch.arange(at, at + last - first))
                    parts.append(mm.features[i][first:last])
                if req.is_last_context_chunk:
                    mm.features = {}
            base += min(size, req.prompt_len - start)
        if not rows:
            return None
        return torch.cat(rows).to(self.device, non_blocking=True), torch.cat(parts)
