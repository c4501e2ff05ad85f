"""How a request ends beyond the scheduler's token-level stops (EOS, a stop id,
max_tokens): which status wins when a grammar completes or a stop string or a failed
grammar fires on the same token, and the empty output an ended request gets (abort,
error). Apart from `LLMEngine` so the precedence rules read in one place."""

from __future__ import annotations

from collections.abc import Callable

from carpool.core.request import Request, RequestStatus
from carpool.engine.request_state import RequestState, request_metrics
from carpool.outputs import StepOutput


def finish_on_complete_grammar(scheduler, request: Request) -> None:
    """`stop`, also when the grammar completed on the very token that reached max_tokens."""
    if request.status == RequestStatus.FINISHED_LENGTH:
        request.status = RequestStatus.FINISHED_STOPPED
    elif not request.is_finished:
        scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED)


def finish_over_token_stop(scheduler, request: Request, status: RequestStatus,
                           stop_reason: str | None = None) -> None:
    """Finish `request` with `status` (a stop string, a failed grammar), winning over a
    token-level stop (EOS, a stop id, max_tokens) that fired on the same token."""
    if request.is_finished:
        request.status = status
    else:
        scheduler.finish_requests([request.request_id], status)
    request.stop_reason = stop_reason


def final_output(state: RequestState, reason: str, clock: Callable[[], float],
                 error: str | None = None, error_code: str | None = None) -> StepOutput:
    """The last output of a request ended without new tokens (`reason`: abort, error)."""
    request = state.request
    return StepOutput(
        request_id=request.request_id, new_token_ids=[], new_text="",
        num_prompt_tokens=request.num_prompt_tokens, num_output_tokens=state.num_sent_tokens,
        num_cached_tokens=request.num_cached_tokens or 0, finish_reason=reason, error=error,
        error_code=error_code, request_metrics=request_metrics(request, clock))
