"""The checks of ``EventPublisher``'s options, before any socket is opened: each bad
value a WireError naming the option (never ZeroMQ's error at bind, nor Python's at the
replay buffer's allocation).
"""

from __future__ import annotations

from ..errors import is_endpoint, is_utf8
from .wire import WireError

MAX_BUFFER_STEPS = 1 << 32
"""The most batches a replay buffer may keep (vLLM's default is 10,000; a larger count
is a mistake, and past ``sys.maxsize`` Python cannot even size the buffer)."""



def check_publisher_options(endpoint: object, replay_endpoint: object, topic: object,
                            buffer_steps: object, max_queue: object, heartbeat: object,
                            hwm: object) -> None:
    """WireError unless ``endpoint`` (and ``replay_endpoint`` when not None) is a ZeroMQ
    endpoint (``transport://address``, UTF-8 text), ``topic`` a str of UTF-8 text,
    ``buffer_steps`` an int in [1, MAX_BUFFER_STEPS], ``max_queue`` an int >= 1,
    ``heartbeat`` a number of seconds > 0 or None and ``hwm`` an int >= 0."""
    for name, value, high in (("buffer_steps", buffer_steps, MAX_BUFFER_STEPS),
                              ("max_queue", max_queue, None)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1 or (
                high is not None and value > high):
            bound = ">= 1" if high is None else f"in [1, {high:,}]"
            raise WireError(f"{name} must be an int {bound}, got {value!r}")
    if heartbeat is not None and (isinstance(heartbeat, bool) or not isinstance(
            heartbeat, (int, float)) or not heartbeat > 0):
        raise WireError(f"heartbeat must be > 0 seconds or None, got {heartbeat!r}")
    if not isinstance(hwm, int) or isinstance(hwm, bool) or hwm < 0:
        raise WireError(f"hwm must be an int >= 0 (0: no limit), got {hwm!r}")
    if not is_utf8(topic):
        raise WireError(f"topic must be a str of UTF-8 text, got {topic!r}"[:200])
    for name, text in (("endpoint", endpoint), ("replay_endpoint", replay_endpoint)):
        if name == "endpoint" or text is not None:
            if not is_endpoint(text):
                raise WireError(f"{name} must be a ZeroMQ endpoint str (transport://address, "
                                f"as tcp://127.0.0.1:*), got {text!r}"[:200])
