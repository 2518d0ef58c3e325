"""A request's choices against a stand-in LLM: outputs posted from the engine's thread reach
each stream in order (one wake-up of the event loop for all that came meanwhile), and a
stream's end cancels only what has not finished (a finished request sends nothing more to the
engine). And which chats the front renders on its event loop (short text ones) rather than on a
worker thread."""

import asyncio
import threading

from tensorrt_llm.llmapi.outputs import CompletionOutput, RequestOutput
from tensorrt_llm.serve.submission import Submission


class StandIn:
    """Submits by starting a thread that posts ``steps`` outputs (the last one finished unless
    ``endless``); records the cancels."""

    def __init__(self, steps: int, endless: bool = False) -> None:
        self.steps, self.endless = steps, endless
        self.cancelled: list[int] = []
        self.threads: list[threading.Thread] = []
        self.next_id = 0

    def check(self, job) -> None:
        pass

    def submit(self, job, on_update) -> int:
        rid, self.next_id = self.next_id, self.next_id + 1

        def run() -> None:
            for step in range(self.steps):
                finished = step == self.steps - 1 and not self.endless
                tokens = list(range(step + 1))
                out = CompletionOutput(0, "", tokens, avg_decoded_tokens_per_iter=1.0)
                on_update(RequestOutput(rid, None, [1], [out], finished))

        thread = threading.Thread(target=run)
        self.threads.append(thread)
        thread.start()
        return rid

    def cancel(self, request_id: int) -> None:
        self.cancelled.append(request_id)


def run(llm: StandIn, choices: int, read: int | None = None) -> list[list[int]]:
    """``choices`` jobs through one Submission; each stream read to its end (or ``read``
    outputs), then the submission's end; the token counts each stream saw, in order."""

    async def main() -> list[list[int]]:
        timer = _Timer()
        submission = Submission(llm, ["job"] * choices, timer, False, choices, "messages")
        seen = []
        for stream in submission.streams:
            counts = []
            async for output in stream:
                counts.append(len(output.outputs[0].token_ids))
                if read is not None and len(counts) == read:
                    break
            await stream.aclose()
            seen.append(counts)
        submission.cancel()  # (what the response's end calls, however it ended)
        return seen

    seen = asyncio.run(main())
    for thread in llm.threads:
        thread.join()
    return seen


class _Timer:
    def fork(self):
        return self

    def update(self, *args) -> None:
        pass


def test_outputs_from_the_engines_thread_arrive_in_order_and_a_finished_stream_cancels_nothing():
    llm = StandIn(steps=200)
    seen = run(llm, choices=3)
    for counts in seen:  # (outputs that came together are merged: each holds all so far)
        assert counts[-1] == 200 and counts == sorted(set(counts))
    assert llm.cancelled == []


def test_a_stream_left_before_its_end_cancels_its_request():
    llm = StandIn(steps=5, endless=True)
    run(llm, choices=2, read=1)
    assert sorted(llm.cancelled) == [0, 1]


def test_a_short_text_chat_is_rendered_here_and_any_other_is_left_to_a_worker_thread():
    from types import SimpleNamespace

    from tensorrt_llm.bundled import BUNDLED_TARGET
    from tensorrt_llm.serve.media import INLINE_MESSAGES, INLINE_TEXT_CHARS, short_chat_prompt
    from tensorrt_llm.serve.openai_protocol import ChatMessage
    from tensorrt_llm.tokenizer import TransformersTokenizer

    tokenizer = TransformersTokenizer.from_pretrained(BUNDLED_TARGET)
    llm = SimpleNamespace(tokenizer=tokenizer)

    def chat(*contents):
        return [ChatMessage(role="user", content=c) for c in contents]

    plain = [{"role": "user", "content": "How many cups?"}]
    expected = tokenizer.encode(tokenizer.apply_chat_template(plain))
    assert short_chat_prompt(llm, chat("How many cups?")) == expected
    assert short_chat_prompt(llm, chat("x" * (INLINE_TEXT_CHARS + 1))) is None
    assert short_chat_prompt(llm, chat(*["hi"] * (INLINE_MESSAGES + 1))) is None
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    assert short_chat_prompt(llm, chat([{"type": "text", "text": "what?"}, image])) is None
