"""What the server accepts: a request's JSON body within its size limit, an admin setting, a pass's examples; every
refusal is a RequestError with its HTTP status and a message naming the field."""

from __future__ import annotations

import json
import logging
import math
from typing import Any, Optional

from starlette.requests import ClientDisconnect

log = logging.getLogger("harness.serve")


class RequestError(Exception):
    """A request the server refuses: HTTP status and a message naming the field."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


# Losses are weighted sums of log-probabilities in float32 (or bfloat16, same range): weights
# this large would overflow them, so such a request is refused rather than answered with inf.
MAX_WEIGHT = 1e30


def parse_setting(body: Any, name: str, ceiling: int, allow_null: bool = True) -> Optional[int]:
    """The ``value`` of an admin set request: a positive integer up to ``ceiling``, or null."""
    if not isinstance(body, dict) or "value" not in body:
        raise RequestError(422, f'{name}: expected a JSON object {{"value": <positive integer> or null}}')
    value = body["value"]
    if value is None and allow_null:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise RequestError(422, f"{name}: value must be a positive integer{' or null' if allow_null else ''}, got "
                                f"{json.dumps(value)}")
    if value > ceiling:
        raise RequestError(422, f"{name}: value {value} is above the server's ceiling {ceiling}")
    return value


def parse_examples(body: Any, vocab_size: int, max_tokens: int):
    """Examples from a pass request, checked field by field; returns backends.messages.Example objects."""
    import numpy as np

    from backends.messages import Example

    if not isinstance(body, dict) or not isinstance(body.get("examples"), list) or not body["examples"]:
        raise RequestError(422, 'examples: expected {"examples": [{"input_ids": [...], "target_tokens": [...], '
                                '"weights": [...]}, ...]} with at least one example')
    total = 0
    total_weight = 0.0
    out = []
    for i, ex in enumerate(body["examples"]):
        where = f"examples[{i}]"
        if not isinstance(ex, dict):
            raise RequestError(422, f"{where}: expected an object with input_ids, target_tokens and weights")
        arrays = {}
        for key in ("input_ids", "target_tokens", "weights"):
            value = ex.get(key)
            if not isinstance(value, list) or not value:
                raise RequestError(422, f"{where}.{key}: expected a non-empty list")
            if key == "weights":
                if not all(isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w)
                           and 0 <= w <= MAX_WEIGHT for w in value):
                    raise RequestError(422, f"{where}.weights: every weight must be a finite number in "
                                            f"0..{MAX_WEIGHT:g}")
                arrays[key] = np.asarray(value, dtype=np.float32)
                total_weight += float(arrays[key].sum(dtype=np.float64))
                if total_weight > MAX_WEIGHT:
                    raise RequestError(422, f"{where}.weights: the request's weights sum to more than {MAX_WEIGHT:g}")
            else:
                if not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
                    raise RequestError(422, f"{where}.{key}: every token must be an integer")
                # checked as Python integers: one past int64 (10**30) would overflow numpy before any range check
                if min(value) < 0 or max(value) >= vocab_size:
                    bad = next(t for t in value if not 0 <= t < vocab_size)
                    raise RequestError(422, f"{where}.{key}: token ids must lie in 0..{vocab_size - 1} (the model's "
                                            f"vocabulary), got {bad}")
                arrays[key] = np.asarray(value, dtype=np.int64)
        n = {k: len(v) for k, v in arrays.items()}
        if len(set(n.values())) != 1:
            raise RequestError(
                422, f"{where}: input_ids, target_tokens and weights must have the same length, got {n['input_ids']}, "
                     f"{n['target_tokens']}, {n['weights']}"
            )
        total += n["input_ids"]
        if total > max_tokens:
            raise RequestError(413, f"examples: more than {max_tokens} tokens in one request "
                                    "(server.max_request_tokens)")
        out.append(Example(arrays["input_ids"], arrays["target_tokens"], arrays["weights"]))
    return out


async def json_body(request, max_bytes: int) -> Any:
    """The request's JSON body, within server.max_request_bytes; a RequestError otherwise."""
    length = request.headers.get("content-length")
    if length is None:
        raise RequestError(411, "a Content-Length header is required")
    if int(length) > max_bytes:
        raise RequestError(413, f"request body of {int(length)} bytes is above server.max_request_bytes "
                                f"({max_bytes})")
    try:
        raw = await request.body()
    except ClientDisconnect:
        # Nobody is left to answer; one line instead of an ASGI traceback.
        log.info("%s %s: the client left before sending its whole request", request.method, request.url.path)
        raise RequestError(400, "the client disconnected before the request was complete") from None
    try:
        return json.loads(raw)
    except ValueError:
        raise RequestError(422, "the body is not valid JSON") from None
