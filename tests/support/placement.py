"""Where the gateway places an image, computed as its encoder pool does: tests put work on a chosen Eric by
construction instead of hoping random ports spread it."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from epd_gateway.content import MediaRef
from epd_gateway.members import rendezvous_weight

from eric_epd.testing.exactness import MIN_STEPS, NEAR_TIE_FLOAT32, Greedy, agreeing_steps
from eric_epd.testing.media import image_data_url


def rendezvous_first(media_url: str, encoder_urls: Iterable[str]) -> str:
    """The encoder URL this media URL goes to when every encoder is healthy and none is loaded."""
    key = MediaRef(0, 0, "image", media_url).routing_key
    return max(encoder_urls, key=lambda url: rendezvous_weight(key, url))


def sets_placed_on(
    target: str, encoder_urls: list[str], count: int, seed: int, reference: Callable[[list[str]], Greedy]
) -> tuple[list[list[str]], list[Greedy]]:
    """`count` sets of three images, each with at least one placed on `target` and a `reference` answer with no near
    tie in its first MIN_STEPS steps; and those answers. The placement depends on the servers' random ports, so the
    sets differ from run to run: one whose answer ties early would leave its comparisons too few steps."""
    sets: list[list[str]] = []
    answers: list[Greedy] = []
    while len(sets) < count:
        images = [image_data_url(56 + 8 * k, 64, seed=seed + k) for k in range(3)]
        seed += 10
        if any(rendezvous_first(u, encoder_urls) == target for u in images):
            answer = reference(images)
            if agreeing_steps(answer, answer, NEAR_TIE_FLOAT32) >= MIN_STEPS:
                sets.append(images)
                answers.append(answer)
    return sets, answers
