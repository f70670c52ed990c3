"""What a test may assert exactly on any CPU, and how it compares where it may not: greedy tokens up to the first
near tie, 8-bit images as roundings of a float image near the reference, and a switch to another instruction set.

Two correct computations that order their float sums differently (another tower, another batch shape, another
instruction set) differ in the last bits. A discrete result built on them (a greedy token, an 8-bit pixel) is then
equal only where the float value is not within that difference of a decision boundary, which holds by luck on one
CPU and fails on another. These helpers assert exactly what holds everywhere and nothing more.

`python -m eric_epd.testing.exactness` prints the environment that moves torch, oneDNN and MKL to another
instruction set than this host's best (`scripts/test_other_isa.sh` runs the exactness tests under it).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

# How far two correct runs' logprobs may drift apart at a step they share the context of (another tower, batch or
# instruction set): measured up to 5e-6 in float32 and 0.047 in bfloat16 here (three bfloat16 steps of 2**-6 at these
# logprobs' magnitude). A step whose two best logprobs are closer than this may pick either token on another CPU.
# Wrong rows must exceed the bound (assert_greedy_differ): in float32 other images' drift is 0.02 to 1 (over 20x); in
# bfloat16 tiny Qwen3.5 given four other images of the same sizes drifted 0.22 to 0.28, one other image 0.156 to 0.25
# (transformers, five seeds), so the bfloat16 bound sits between the two at about twice the right runs' drift and
# half the wrong ones' (0.15 let one wrong pair in five through).
NEAR_TIE_FLOAT32 = 1e-3
NEAR_TIE_BFLOAT16 = 0.1


@dataclass(frozen=True)
class Greedy:
    """A greedy generation: each step's token (id, or text from the chat API), its logprob and its margin (best
    minus second-best logprob)."""

    tokens: list[int | str]
    best: list[float]
    margins: list[float]

    def to_json(self) -> dict[str, list]:
        """The generation as JSON-ready lists (what `vllm_cases` writes)."""
        return {"tokens": self.tokens, "best": self.best, "margins": self.margins}

    @classmethod
    def from_json(cls, data: dict[str, list]) -> Greedy:
        """A generation read back from `to_json`'s dict."""
        return cls(list(data["tokens"]), list(data["best"]), list(data["margins"]))

    @classmethod
    def of_steps(cls, tokens: list[int | str], steps: list[Sequence[float]]) -> Greedy:
        """From each step's candidate logprobs (the two best, in any order)."""
        ranked = [sorted(candidates, reverse=True) for candidates in steps]
        return cls(
            tokens, [float(r[0]) for r in ranked], [float(r[0] - r[1]) if len(r) > 1 else float("inf") for r in ranked]
        )


def greedy_of_vllm(completion: Any) -> Greedy:
    """From vLLM's CompletionOutput sampled with `logprobs=2` (each step's dict of token id -> Logprob)."""
    steps = completion.logprobs
    assert steps is not None, "sample with SamplingParams(logprobs=2) to compare greedy runs"
    return Greedy.of_steps(list(completion.token_ids), [[lp.logprob for lp in step.values()] for step in steps])


def greedy_of_openai(choice: Any) -> Greedy:
    """From an OpenAI chat choice asked with `logprobs=True, top_logprobs=2`: token ids where vLLM returned them
    (`return_token_ids`), else the token texts the chat API names them by."""
    content = choice.logprobs.content if choice.logprobs else None
    assert content, "ask with logprobs=True, top_logprobs=2 to compare greedy runs"
    ids = getattr(choice, "token_ids", None)
    tokens = list(ids) if ids else [t.token for t in content]
    return Greedy.of_steps(tokens, [[c.logprob for c in t.top_logprobs] for t in content])


def agreeing_steps(ours: Greedy, reference: Greedy, near_tie: float) -> int:
    """The steps both runs must agree on: all of them up to the first where either run's margin is below `near_tie`
    (there another CPU's rounding may pick the other token, and every later step follows from that pick)."""
    for step, (a, b) in enumerate(zip(ours.margins, reference.margins)):
        if min(a, b) < near_tie:
            return step
    return min(len(ours.tokens), len(reference.tokens))


MIN_STEPS = 3
"""Fewest greedy steps a comparison checks token for token before a near tie: a tie at the first step compares
nothing, so it fails rather than passes (pick another prompt or seed)."""


def greedy_mismatch(ours: Greedy, reference: Greedy, near_tie: float) -> str | None:
    """Why `ours` is not `reference`'s answer up to the first near tie (None where it is): another number of steps,
    logprobs or margins apart by more than `near_tie` at a step the two share the context of (those before the near
    tie and its own), or another token before it."""
    if len(ours.tokens) != len(reference.tokens):
        return f"{len(ours.tokens)} vs {len(reference.tokens)} steps"
    steps = agreeing_steps(ours, reference, near_tie)
    shared = min(steps + 1, len(ours.tokens))
    drift = max(
        (
            abs(a - b)
            for x, y in ((ours.best, reference.best), (ours.margins, reference.margins))
            for a, b in zip(x[:shared], y[:shared])
        ),
        default=0.0,
    )
    if drift > near_tie:
        return f"logprobs drift by {drift:.3g} > {near_tie} over the {shared} shared steps"
    if ours.tokens[:steps] != reference.tokens[:steps]:
        return (
            f"greedy tokens differ before any near tie (margin < {near_tie}): {ours.tokens} vs {reference.tokens}, "
            f"margins {[round(m, 4) for m in ours.margins]} vs {[round(m, 4) for m in reference.margins]}"
        )
    return None


def assert_greedy_agree(
    ours: Greedy, reference: Greedy, near_tie: float, label: str = "", *, min_steps: int = MIN_STEPS
) -> None:
    """`ours` is `reference`'s answer (greedy_mismatch finds nothing), compared token for token over at least
    `min_steps` steps. Every test that calls it also runs `assert_greedy_differ` on wrong input (a project test
    checks): a comparison that no wrong answer fails proves nothing."""
    problem = greedy_mismatch(ours, reference, near_tie)
    assert problem is None, f"{label}: {problem}"
    steps = agreeing_steps(ours, reference, near_tie)
    logger.info("%s: %d of %d greedy steps before a near tie (< %g)", label, steps, len(ours.tokens), near_tie)
    assert steps >= min_steps, (
        f"{label}: a near tie (margin < {near_tie}) after {steps} of {len(ours.tokens)} steps leaves fewer than "
        f"{min_steps} compared: margins {[round(m, 4) for m in ours.margins]} vs "
        f"{[round(m, 4) for m in reference.margins]}"
    )


def assert_greedy_differ(wrong: Greedy, reference: Greedy, near_tie: float, label: str = "") -> None:
    """The negative control beside assert_greedy_agree: an answer from wrong rows (another image's, another clip's)
    fails the same comparison with `reference`, so the bound tells right rows from wrong."""
    assert greedy_mismatch(wrong, reference, near_tie) is not None, (
        f"{label}: the negative control passed: wrong input's answer agrees with the reference within {near_tie} "
        f"({wrong.tokens} vs {reference.tokens})"
    )


# Geri's float image (in [0, 1]) against diffusers' for the same request, in another batch, process, thread count or
# instruction set: 6e-7 apart at most here (a few float32 ulps near 1); the bound leaves a factor of over ten.
IMAGE_FLOAT_BOUND = 1e-5


def assert_rounds_from(image: np.ndarray, reference: np.ndarray, bound: float = IMAGE_FLOAT_BOUND) -> None:
    """`image` (uint8) is the 8-bit rounding of some float image within `bound` of `reference` (floats in [0, 1],
    as the pipeline's output_type="np"): each pixel within 0.5 + 255 * bound levels of reference * 255. Exact
    except where the reference lies that close to a rounding boundary, so this is as strict as any CPU allows."""
    assert image.dtype == np.uint8 and image.shape == reference.shape, (image.dtype, image.shape, reference.shape)
    levels = np.abs(image.astype(np.float64) - reference.astype(np.float64) * 255)
    worst = np.unravel_index(int(levels.argmax()), levels.shape)
    assert levels.max() <= 0.5 + 255 * bound, (
        f"pixel {worst}: {image[worst]} is not a rounding of {reference[worst] * 255:.6f} +- {255 * bound:.2g}"
    )


def assert_floats_close(ours: np.ndarray, reference: np.ndarray, bound: float = IMAGE_FLOAT_BOUND) -> None:
    """Two float images within `bound` everywhere (absolute: both in [0, 1])."""
    assert ours.shape == reference.shape, (ours.shape, reference.shape)
    worst = float(np.abs(ours.astype(np.float64) - reference.astype(np.float64)).max())
    assert worst <= bound, f"float images differ by {worst:.3g} > {bound:.3g}"


# A vision tower compiled by `--compile inductor` against the same tower run eagerly, both measured against the tower
# in float64: the compiled rows may be at most this many times farther from float64 than the eager rows in the same
# dtype (fused reductions sum in another order; in bfloat16 a fused kernel keeps its intermediates in float32 where
# eager rounds each op's output). A bound relative to the eager tower's own rounding scales with depth and width, so
# it holds on the benchmark's checkpoints as on the tiny ones (a fixed bound did not: 9.4e-6 and 3.8e-2 on `small`
# against 5e-6 and 2e-2). Measured 0.80-1.35x (the tiny towers of three families and `small`, float32 and bfloat16,
# on an AVX-512 CPU with AMX); a missing block or a wrong scale is orders above it.
COMPILED_OVER_EAGER = 4.0


def compiled_as_exact(compiled: Any, eager: Any, exact: Any, what: str) -> tuple[float, float]:
    """Assert the compiled rows no farther from the float64 rows than COMPILED_OVER_EAGER times the eager rows'
    distance; return both distances (relative_error)."""
    ours, theirs = relative_error(compiled, exact), relative_error(eager, exact)
    assert ours <= COMPILED_OVER_EAGER * theirs, (
        f"{what}: compiled rows {ours:.2e} from float64, {ours / theirs:.1f}x the eager rows' {theirs:.2e} "
        f"(bound {COMPILED_OVER_EAGER}x)"
    )
    return ours, theirs


# A vision tower computing in bfloat16 (--compute-dtype bfloat16, rows sent in bfloat16) against the same tower in
# float32: the worst difference over the largest |row value|. Measured up to 7.1e-3 on the tiny Qwen2.5-VL (two images
# of 12 and 20 tokens in one batch, four seeds, one thread, on a CPU with AVX512-BF16 and AMX), where another image's
# rows of the same sizes are 0.66 to 1.0 from the float32 rows; the bound leaves a factor of about three over the
# right rows and thirty under the wrong ones.
BFLOAT16_TOWER_FROM_FLOAT32 = 2e-2


def relative_error(ours: Any, reference: Any) -> float:
    """max |ours - reference| / max |reference| (tensors or arrays), in float64."""
    ours, reference = (np.asarray(t.float().cpu() if hasattr(t, "float") else t, np.float64) for t in (ours, reference))
    assert ours.shape == reference.shape, (ours.shape, reference.shape)
    return float(np.abs(ours - reference).max() / max(np.abs(reference).max(), 1e-30))


# torch's ATEN_CPU_CAPABILITY, oneDNN's and MKL's instruction-set caps one step below each host's best.
_CAPS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
MOVED = "ERIC_EPD_TEST_ISA_MOVED"
"""Set once move_this_process has run this process on the lower set (its servers then start on the best)."""
_LOWER = {
    "AVX512": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "AVX2": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
}


def other_isa_env() -> dict[str, str]:
    """Environment that runs a torch process on another instruction set than this host's best (AVX-512 -> AVX2,
    AVX2 -> SSE4), for servers whose results a test compares with its own: a test exact only by one instruction
    set's luck fails here rather than on a user's machine. Empty where the host has no lower set to move to, or
    where this process itself already runs on another one (see move_this_process)."""
    import torch

    if "ATEN_CPU_CAPABILITY" in os.environ or MOVED in os.environ:
        return {}
    capability = torch.backends.cpu.get_cpu_capability().upper()
    return next((dict(env) for name, env in _LOWER.items() if capability.startswith(name)), {})


def move_this_process() -> str | None:
    """Where this process was started with the caps (scripts/test_other_isa.sh): initialise torch, MKL and oneDNN
    under them, then take them out of the environment, so that the servers and engines it starts run on the
    host's best set and every comparison of theirs with this process's references crosses instruction sets (vLLM's
    compiled kernels do not build without vector instructions). Returns the capability this process runs on."""
    import torch

    if "ATEN_CPU_CAPABILITY" not in os.environ:
        return None
    capability = torch.backends.cpu.get_cpu_capability()
    for dtype in (torch.float32, torch.bfloat16):  # the first GEMM of each kind reads MKL's and oneDNN's caps
        a = torch.ones(64, 64, dtype=dtype)
        torch.nn.functional.linear(a, a)
        torch.nn.functional.layer_norm(a, (64,))
    for name in _CAPS:
        os.environ.pop(name, None)
    os.environ[MOVED] = capability
    return capability


def main() -> None:
    """Print the other instruction set's environment as NAME=value lines (for `env`)."""
    for name, value in other_isa_env().items():
        sys.stdout.write(f"{name}={value}\n")


if __name__ == "__main__":
    main()
