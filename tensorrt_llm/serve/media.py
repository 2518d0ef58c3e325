"""The images of a chat request: where an ``image_url`` may point, and the limits on what it holds.

- ``data:image/...;base64,...``: decoded here;
- ``file:///path``: only under ``--allowed-local-media-path`` (after resolving links); refused
  when the server was started without one;
- ``http://`` / ``https://``: fetched under the policy of ``media_fetch.py`` (global addresses
  only, or the hosts of ``--allowed-media-domains``; one deadline; the size cap while reading).
  Whatever goes wrong between such a URL and a decoded image, the client is told the same thing
  (``UNFETCHABLE``); the reason is logged.

A request's images are fetched and decoded as one job of the server's ``MediaPool``: a bounded
number run at once (a 503 past it), decoding on the pool's own threads (never the threads that
render templates and tokenize), and the job is cancelled when its client goes away. Each refusal
is a 400 whose ``param`` names the content part (``messages.1.content.0``).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from tensorrt_llm._torch.pyexecutor.multimodal import ImageItem
from tensorrt_llm.inputs import IMAGE_TOKEN
from tensorrt_llm.logger import logger
from tensorrt_llm.serve import guards
from tensorrt_llm.serve.errors import ServerError
from tensorrt_llm.serve.media_fetch import FetchPolicy, FetchRefused, fetch

MAX_IMAGE_BYTES = 20 * 1024 * 1024
FETCH_TIMEOUT_S = 10.0
MAX_MEDIA_JOBS = 8  # requests whose images are fetched or decoded at once
DECODE_THREADS = 2
UNFETCHABLE = "could not get an image from this URL"
INLINE_TEXT_CHARS = 8192  # a text-only chat up to this size (and this many messages) is
INLINE_MESSAGES = 64  # rendered and tokenized on the event loop


@dataclass(frozen=True)
class MediaOptions:
    allowed_local_media_path: Path | None = None
    # hosts image URLs may name (then no other); they may resolve to private addresses
    allowed_media_domains: frozenset[str] = field(default_factory=frozenset)
    max_image_bytes: int = MAX_IMAGE_BYTES
    fetch_timeout_s: float = FETCH_TIMEOUT_S
    max_jobs: int = MAX_MEDIA_JOBS

    def __post_init__(self) -> None:
        domains = frozenset(d.lower().rstrip(".") for d in self.allowed_media_domains)
        object.__setattr__(self, "allowed_media_domains", domains)

    @property
    def policy(self) -> FetchPolicy:
        return FetchPolicy(self.allowed_media_domains, self.fetch_timeout_s, self.max_image_bytes)


class MediaPool:
    """Runs at most ``options.max_jobs`` requests' image work at once, decoding on its own
    threads. ``busy`` is a 503 for one more."""

    def __init__(self, options: MediaOptions) -> None:
        self.options = options
        self.num_jobs = 0
        self.decoder = ThreadPoolExecutor(DECODE_THREADS, thread_name_prefix="trtllm-media")

    def admit(self) -> None:
        if self.num_jobs >= self.options.max_jobs:
            raise ServerError(
                503,
                f"{self.num_jobs} requests' images are being fetched or decoded, the most this "
                "server takes at once; retry later",
                "server_error",
            )

    async def decode(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.decoder, fn, *args)

    def close(self) -> None:
        self.decoder.shutdown(wait=False, cancel_futures=True)


def image_parts(messages) -> list[tuple[str, str]]:
    """``(param, url)`` of every image part, in order; images only in user messages."""
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message.content, list):
            continue
        for j, part in enumerate(message.content):
            if part.type != "image_url":
                continue
            where = f"messages.{i}.content.{j}"
            if message.role != "user":
                raise ServerError(400, f"{where}: images are taken in user messages", param=where)
            out.append((where, part.image_url.url))
    return out


async def image_item(url: str, where: str, pool: MediaPool, processor) -> ImageItem:
    """The processed image an ``image_url`` names."""
    options = pool.options
    if url.startswith(("http://", "https://")):
        try:
            data = await fetch(url, options.policy)
            return await pool.decode(processor, data)
        except (FetchRefused, ValueError, TypeError) as exc:
            logger.info("%s: image URL refused: %s", where, exc)
            raise ServerError(400, f"{where}: {UNFETCHABLE}", param=where) from None
    if url.startswith("data:"):
        data = _data_url(url, where)
    elif url.startswith("file://"):
        data = await pool.decode(_local_file, url.removeprefix("file://"), where, options)
    else:
        scheme = url.split(":", 1)[0] if ":" in url else url[:16]
        raise ServerError(
            400,
            f"{where}: image_url scheme {scheme[:16]!r} is not served; use data:, http(s): or "
            "file:",
            param=where,
        )
    if len(data) > options.max_image_bytes:
        raise ServerError(
            400,
            f"{where}: image of {len(data)} bytes; at most {options.max_image_bytes}",
            param=where,
        )
    try:
        return await pool.decode(processor, data)
    except (ValueError, TypeError) as exc:
        raise ServerError(400, f"{where}: {exc}", param=where) from None


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
    if "\x00" in path:
        raise ServerError(400, f"{where}: a file path may not hold a NUL character", param=where)
    resolved = Path(path).resolve()
    if not resolved.is_relative_to(Path(root).resolve()):
        raise ServerError(400, f"{where}: {path!r} is outside the allowed media path", param=where)
    if not resolved.is_file():
        raise ServerError(400, f"{where}: no file {path!r}", param=where)
    try:
        if resolved.stat().st_size > options.max_image_bytes:
            raise ServerError(
                400, f"{where}: file larger than {options.max_image_bytes} bytes", param=where
            )
        return resolved.read_bytes()
    except OSError as exc:
        message = f"{where}: {path!r} cannot be read ({exc.strerror})"
        raise ServerError(400, message, param=where) from None


def short_chat_prompt(llm, messages, variables: dict | None = None) -> list[int] | None:
    """The token ids of a text-only chat of at most ``INLINE_TEXT_CHARS`` characters in at most
    ``INLINE_MESSAGES`` messages, rendered and tokenized on the calling thread (the event
    loop's); None for any other chat. Below that size the work takes a fraction of a
    millisecond, less than the hop to a worker thread and back, which behind the streams' work
    waits for the interpreter's lock (a few ms per hop)."""
    if len(messages) > INLINE_MESSAGES or image_parts(messages):
        return None
    if sum(len(m.text()) for m in messages) > INLINE_TEXT_CHARS:
        return None
    marked = [m.for_template() for m in messages]
    return _render(llm.tokenizer, marked, tokenize=True, variables=variables)[1]


def _render(
    tokenizer, marked: list[dict], tokenize: bool, variables: dict | None = None
) -> tuple[str, list[int] | None]:
    """The chat's text through the checkpoint's template, with the request's template
    ``variables`` (tokenized too with ``tokenize``); a conversation the template refuses
    (``raise_exception``) is a 400."""
    try:
        text = tokenizer.apply_chat_template(marked, **(variables or {}))
    except ValueError as exc:
        raise ServerError(400, str(exc), param="messages") from None
    guards.refuse_formed_tokens(tokenizer, marked, variables or {}, text)
    return text, tokenizer.encode(text) if tokenize else None


async def chat_prompt(
    llm, messages, pool: MediaPool, known=None, variables: dict | None = None
) -> list[int] | dict:
    """The prompt of a chat: its token ids, or (with images) upstream's prompt dict holding the
    expanded token ids and the processed images. Refusals are 400s naming the part.

    ``known``: a generation-only request's ``disaggregated_params.images``: the context server
    processed the images; their token counts and digests are all this server needs (nothing is
    fetched)."""
    parts = image_parts(messages)
    marked = [m.for_template(IMAGE_TOKEN) for m in messages]
    # (text only: tokenized in the same hop)
    text, token_ids = await asyncio.to_thread(_render, llm.tokenizer, marked, not parts, variables)
    if token_ids is not None:
        return token_ids
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
    pool.admit()
    pool.num_jobs += 1
    jobs = [asyncio.ensure_future(image_item(u, w, pool, prompts.processor)) for w, u in parts]
    try:  # fetched at once: the request's images take one deadline's time, not one each
        images = await asyncio.gather(*jobs, return_exceptions=True)
    finally:
        for job in jobs:  # (a client gone: its fetches end)
            job.cancel()
        pool.num_jobs -= 1
    for image in images:  # the refusal of the first part that failed, whichever ended first
        if isinstance(image, BaseException):
            raise image
    return await _expanded(prompts, text, images)


async def _expanded(prompts, text: str, images: list) -> dict:
    try:
        prompt = await asyncio.to_thread(prompts.prepare, text, {"image": images})
    except ValueError as exc:
        raise ServerError(400, str(exc), param="messages") from None
    return {"prompt_token_ids": prompt.token_ids, "multi_modal_data": {"image": images}}
