"""ApproxIndex under attack: against a plain model (events and TTL guesses), expiry at
the boundary, a clock that jumps either way, a replica cleared while its guesses live,
and memory under a stream of unique prompts."""

from prefixkv.router import ApproxIndex

TTL = 5.0


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_a_hash_twice_in_one_routed_prompt_expires_once():
    # found by ApproxModel: the second deletion of its expiry raised KeyError
    clock = Clock()
    index = ApproxIndex(TTL, clock=clock)
    index.routed("a", [0, 0])
    clock.t = TTL
    assert index.prefix_runs([0], ["a"]) == {}
