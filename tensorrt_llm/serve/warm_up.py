"""The front's one-time costs, paid before ``/health`` answers rather than by a user's first
request: the chat template's compilation, the request models' first validation, the first
tokenization and detokenization, the loading of the async backend a streamed reply runs on.
Nothing reaches the engine (whose own are paid at its start-up: ``_torch/pyexecutor/warm_up.py``),
so no statistic and no KV slot moves."""

from __future__ import annotations

import time

import anyio

from tensorrt_llm.logger import logger
from tensorrt_llm.serve import media
from tensorrt_llm.serve.openai_protocol import ChatCompletionRequest, CompletionRequest

CHAT = {"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 2, "stream": True}
COMPLETION = {"prompt": "Hello!", "max_tokens": 2, "stream": True}


async def warm_up_front(llm, pool: media.MediaPool) -> None:
    """The chat and completion requests' paths up to the engine. A failure is logged: the server
    starts all the same."""
    start = time.perf_counter()
    try:
        async with anyio.create_task_group():  # (a streamed reply's first loads anyio's backend)
            pass
        chat = ChatCompletionRequest.model_validate(CHAT)
        CompletionRequest.model_validate(COMPLETION)
        if llm.tokenizer is None:  # (token ids in, token ids out)
            return
        prompt = await media.chat_prompt(llm, chat.messages, pool)
        llm.tokenizer.decode(prompt)
    except Exception as exc:  # (a template that refuses this conversation, say)
        logger.warning("the server's warm-up failed (%s); it starts all the same", exc)
        return
    logger.info("front warm-up in %.2f s", time.perf_counter() - start)
