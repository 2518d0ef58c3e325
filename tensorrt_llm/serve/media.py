"""The images of a chat request: where an ``image_url`` may point, and the limits on what it holds.

- ``data:image/...;base64,...``: decoded here;
- ``file:///path``: only under ``--allowed-local-media-path`` (after resolving links); refused
  when the server was started without one;
- ``http://`` / ``https://``: fetched with a time limit and a size limit; a machine without a
  network gets a 400 saying the fetch failed.

Each refusal is a 400 whose ``param`` names the content part (``messages.1.content.0``). Images
per request and pixels per image are limited by the prompt's processing
(``tensorrt_llm.inputs``), which names the image too.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from tensorrt_llm._torch.pyexecutor.multimodal import ImageItem
from tensorrt_llm.inputs import IMAGE_TOKEN
from tensorrt_llm.serve.errors import ServerError

MAX_IMAGE_BYTES = 20 * 1024 * 1024
FETCH_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class MediaOptions:
    allowed_local_media_path: Path | None = None
    max_image_bytes: int = MAX_IMAGE_BYTES
    fetch_timeout_s: float = FETCH_TIMEOUT_S


def image_parts(messages) -> list[tuple[str, str]]:
    """``(param, url)`` of every image part, in order; images only in user messages."""
    out = []
    for i, message in enumerate(messages):
        if isinstance(message.content, str):
            continue
        for j, part in enumerate(message.content):
            if part.type != "image_url":
                continue
            where = f"messages.{i}.content.{j}"
            if message.role != "user":
                raise ServerError(400, f"{where}: images are taken in user messages", param=where)
            out.append((where, part.image_url.url))
    return out


def image_bytes(url: str, where: str, options: MediaOptions) -> bytes:
    """The encoded image an ``image_url`` points at (a blocking call: run it off the loop)."""
    if url.startswith("data:"):
        data = _data_url(url, where)
    elif url.startswith("file://"):
        data = _local_file(url.removeprefix("file://"), where, options)
    elif url.startswith(("http://", "https://")):
        data = _fetch(url, where, options)
    else:
        scheme = url.split(":", 1)[0] if ":" in url else url[:16]
        raise ServerError(
            400,
            f"{where}: image_url scheme {scheme!r} is not served; use data:, http(s): or file:",
            param=where,
        )
    if len(data) > options.max_image_bytes:
        raise ServerError(
            400,
            f"{where}: image of {len(data)} bytes; at most {options.max_image_bytes}",
            param=where,
        )
    return data


def _data_url(url: str, where: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64") or not header.startswith("data:image/"):
        raise ServerError(
            400, f"{where}: a data URL must be data:image/<type>;base64,<data>", param=where
        )
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ServerError(400, f"{where}: the data URL is not valid base64", param=where) from None


def _local_file(path: str, where: str, options: MediaOptions) -> bytes:
    root = options.allowed_local_media_path
    if root is None:
        raise ServerError(
            400,
            f"{where}: local files are served only under --allowed-local-media-path, which this "
            "server was not given",
            param=where,
        )
    resolved = Path(path).resolve()
    if not resolved.is_relative_to(Path(root).resolve()):
        raise ServerError(400, f"{where}: {path!r} is outside the allowed media path", param=where)
    if not resolved.is_file():
        raise ServerError(400, f"{where}: no file {path!r}", param=where)
    if resolved.stat().st_size > options.max_image_bytes:
        raise ServerError(
            400, f"{where}: file larger than {options.max_image_bytes} bytes", param=where
        )
    return resolved.read_bytes()


def _fetch(url: str, where: str, options: MediaOptions) -> bytes:
    limit = options.max_image_bytes
    try:
        with urllib.request.urlopen(url, timeout=options.fetch_timeout_s) as response:  # noqa: S310
            data = response.read(limit + 1)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ServerError(
            400, f"{where}: could not fetch the image ({reason})", param=where
        ) from None
    if len(data) > limit:
        raise ServerError(400, f"{where}: image larger than {limit} bytes", param=where)
    return data


async def chat_prompt(llm, messages, options: MediaOptions, known=None) -> list[int] | dict:
    """The prompt of a chat: its token ids, or (with images) upstream's prompt dict holding the
    expanded token ids and the processed images. Refusals are 400s naming the part.

    ``known``: a generation-only request's ``disaggregated_params.images``: the context server
    processed the images; their token counts and digests are all this server needs (nothing is
    fetched)."""
    parts = image_parts(messages)
    tokenizer = llm.tokenizer
    marked = [{"role": m.role, "content": m.text(IMAGE_TOKEN)} for m in messages]
    try:  # the checkpoint's template may refuse a conversation (raise_exception)
        text = await asyncio.to_thread(tokenizer.apply_chat_template, marked)
    except ValueError as exc:
        raise ServerError(400, str(exc), param="messages") from None
    if not parts:
        return await asyncio.to_thread(tokenizer.encode, text)
    prompts = llm.multimodal
    if prompts.processor is None:
        raise ServerError(400, f"{parts[0][0]}: this model takes no images", param=parts[0][0])
    if len(parts) > prompts.max_images:
        raise ServerError(
            400,
            f"{len(parts)} images in one request; at most {prompts.max_images}",
            param="messages",
        )
    if known is not None:
        if len(known) != len(parts):
            raise ServerError(
                400,
                f"{len(parts)} images for the {len(known)} of disaggregated_params.images",
                param="disaggregated_params",
            )
        images = [ImageItem.known(ref.digest, ref.num_tokens) for ref in known]
        return await _expanded(prompts, text, images)
    images = []
    for where, url in parts:
        data = await asyncio.to_thread(image_bytes, url, where, options)
        try:
            images.append(await asyncio.to_thread(prompts.processor, data))
        except (ValueError, TypeError) as exc:
            raise ServerError(400, f"{where}: {exc}", param=where) from None
    return await _expanded(prompts, text, images)


async def _expanded(prompts, text: str, images: list) -> dict:
    try:
        prompt = await asyncio.to_thread(prompts.prepare, text, {"image": images})
    except ValueError as exc:
        raise ServerError(400, str(exc), param="messages") from None
    return {"prompt_token_ids": prompt.token_ids, "multi_modal_data": {"image": images}}
