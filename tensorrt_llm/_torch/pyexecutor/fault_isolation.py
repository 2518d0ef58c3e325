"""What a failed step costs: the request that made it fail, not its batch.

Requests are checked when they are admitted (``PyExecutor.check_request``, ``SamplingRow``), so a
step that still raises is a fault nobody foresaw: a kernel that cannot take one request's shape,
memory one request's prefill needs, a bug. The batch's requests are then **suspects**: none of
them has moved (a failed launch neither advances a request nor counts its tokens), so each can run
the same step again. From the next step on, a batch that holds a suspect holds only that one; it
either runs (and is cleared) or fails alone and ends with the step's error. The other requests of
the failed batch go on where they were, one solo step later each. If none fails alone, the batch
failed for its size (memory a large batch needs, say): batches then keep to half that size for a
while, so the same batch does not form and fail again.

This needs every rank to see the same failure. A server of several ranks runs each step on all of
them, and a fault one rank saw is not one the others can retry in step; there a failed step still
ends its whole batch, each request with a message that says the engine failed and it was in it.
"""

from __future__ import annotations

from tensorrt_llm._torch.pyexecutor.llm_request import ErrorKind, LlmRequest
from tensorrt_llm._torch.pyexecutor.scheduler import ScheduledRequests
from tensorrt_llm.logger import logger, plain_message

CAP_STEPS = 64  # steps a batch-size cap holds after a batch failed as a whole


def describe(exc: BaseException) -> str:
    """An exception as a request's error message: its type and its first line, never empty."""
    return f"{type(exc).__name__}: {plain_message(exc, 'a step')}"


class FaultIsolation:
    def __init__(self) -> None:
        self.suspects: set[int] = set()  # request ids of failed batches not yet run alone
        self.num_retried = 0  # requests run again, alone, after a failed step
        self.num_failed_alone = 0  # requests that failed a step on their own
        # A failed batch whose requests all then ran alone failed for its size (memory, say):
        # batches are held to half that size for the next ``CAP_STEPS`` steps.
        self._round: tuple[int, int] | None = None  # (failed batch size, culprits found)
        self.cap: int | None = None
        self._cap_steps_left = 0

    def restrict(self, batch: ScheduledRequests) -> None:
        """A batch that holds a suspect runs that suspect alone (the others wait one step); while
        a size cap holds, a batch keeps to it."""
        suspects = [r for r in batch.all_requests if r.request_id in self.suspects]
        if suspects and batch.batch_size > 1:
            batch.pause([r for r in batch.all_requests if r is not suspects[0]])
        elif self.cap is not None:
            batch.pause(batch.all_requests[self.cap :])
            self._cap_steps_left -= 1
            if self._cap_steps_left <= 0:
                self.cap = None

    def passed(self, batch: ScheduledRequests) -> None:
        """``batch`` launched: its requests are cleared."""
        if self.suspects:
            self.suspects.difference_update(r.request_id for r in batch.all_requests)
            self._end_round()

    def _end_round(self) -> None:
        """Every suspect ran alone: none failing means the batch failed as a whole."""
        if self.suspects or self._round is None:
            return
        size, culprits = self._round
        self._round = None
        if culprits == 0:
            self.cap, self._cap_steps_left = max(1, size // 2), CAP_STEPS
            logger.warning(
                "each request of the failed step ran alone: batches keep to %d requests for "
                "%d steps",
                self.cap,
                CAP_STEPS,
            )

    def failed(self, batch: ScheduledRequests, exc: BaseException, retry: bool) -> list[LlmRequest]:
        """``batch``'s launch raised ``exc``: the requests to end now (each given its error).
        With ``retry`` (one rank), a batch of several makes them suspects instead, to run again
        alone."""
        requests = batch.all_requests
        cause = describe(exc)
        if len(requests) == 1:  # it failed on its own
            req = requests[0]
            self.suspects.discard(req.request_id)
            self.num_failed_alone += 1
            if self._round is not None:
                self._round = (self._round[0], self._round[1] + 1)
            req.fail(ErrorKind.ENGINE_FAULT, f"this request failed the engine step ({cause})")
            self._end_round()
            return [req]
        if retry:
            self.suspects.update(r.request_id for r in requests)
            self._round = (len(requests), 0)
            self.num_retried += len(requests)
            logger.warning(
                "a step of %d requests failed (%s); running each of them again alone",
                len(requests),
                cause,
            )
            return []
        for req in requests:
            req.fail(
                ErrorKind.ENGINE_FAULT,
                f"the engine step this request was in failed ({cause}); a server of several "
                "ranks does not retry it",
            )
        return list(requests)

    def forget(self, request: LlmRequest) -> None:
        """``request`` ended (a cancel, a stop): it is no longer a suspect."""
        if request.request_id in self.suspects:
            self.suspects.discard(request.request_id)
            self._end_round()
