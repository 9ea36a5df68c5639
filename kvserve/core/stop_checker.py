"""When does a request stop on a token? (Stop strings need text: the engine checks them after detokenizing.)"""

from __future__ import annotations

from kvserve.core.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> RequestStatus | None:
    """The final status a request reaches with its newest output token, or None to go on.

    Order (as vLLM): EOS (unless ``ignore_eos``) and ``stop_token_ids`` end the request only once
    ``min_tokens`` were generated; ``max_tokens`` and ``max_model_len`` always do. The stopping token is
    kept in ``output_token_ids``; ``stop_reason`` records a matched stop token id.
    """
    params = request.sampling_params
    num_output = request.num_output_tokens
    last = request.output_token_ids[-1]
    if num_output >= params.min_tokens:
        if not params.ignore_eos and last == request.eos_token_id:
            return RequestStatus.FINISHED_STOPPED
        if last in params.stop_token_ids:
            request.stop_reason = last
            return RequestStatus.FINISHED_STOPPED
    if num_output >= request.max_tokens or request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH_CAPPED
    return None
