"""`--compile inductor`: the parts of a vision tower whose shapes vary only in the token count, compiled by torch's
inductor with their weights frozen in and that count dynamic (one compile serves every batch; CUDA graphs on CUDA).

Attention stays eager between them: its segment layout (images, frames, windows) changes with every batch.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)


def inductor_options(device: torch.device) -> dict[str, Any]:
    """torch.compile options for a tower on `device`: weights frozen in as constants (on CPU inductor then
    prepacks them for oneDNN; measured the only setting that pays there), plus CUDA graphs on CUDA (the
    "reduce-overhead" mode, one graph recorded per token count)."""
    return {"freezing": True, "triton.cudagraphs": device.type == "cuda"}


class TokenCompiled:
    """`fn` compiled with inductor at its first call, dim 0 (the tokens) of each tensor argument dynamic and every
    other dim static: one graph for any token count.

    The first call compiles under the settings compiling needs (`compile_settings`); later calls run the graph with
    nothing around them. Freezing makes the weights constants, so each module gets its own graph under the same code
    object (the same method of another block); `recompile_limit` lets that many graphs share it (past it, dynamo
    runs the call eagerly: correct, only slower)."""

    def __init__(self, fn: Callable[..., Any], device: torch.device, recompile_limit: int) -> None:
        self._compiled = torch.compile(fn, dynamic=None, options=inductor_options(device))
        self._recompile_limit = recompile_limit
        self._warm = False

    def __call__(self, *args: Any) -> Any:
        """`fn(*args)` through the compiled graph (compiling it at the first call)."""
        if self._warm:
            return self._compiled(*args)
        for arg in args:
            if isinstance(arg, torch.Tensor):
                torch._dynamo.mark_dynamic(arg, 0)
        with compile_settings(self._recompile_limit):
            out = self._compiled(*args)
        self._warm = True
        return out


@contextlib.contextmanager
def compile_settings(recompile_limit: int) -> Iterator[None]:
    """While a graph compiles: inductor's freezing on (dynamo reads the global flag when it decides to make the
    weights constants; the per-compile option alone reaches only inductor) and room for one graph per module."""
    with torch._dynamo.config.patch(recompile_limit=recompile_limit), torch._inductor.config.patch(freezing=True):
        yield


def compile_methods(modules: Iterable[nn.Module], names: tuple[str, ...], device: torch.device) -> int:
    """Replace each named method of each module by its `TokenCompiled` (on the instance; the class keeps the eager
    one). Returns how many modules were compiled."""
    modules = list(modules)
    limit = len(modules) + 8  # one graph per module shares each method's code, plus room for a recompile or two
    for module in modules:
        for name in names:
            setattr(module, name, TokenCompiled(getattr(module, name), device, limit))
    logger.info(
        "compiling %s of %d %s modules with inductor on %s (at their first call)",
        "/".join(names),
        len(modules),
        type(modules[0]).__name__ if modules else "no",
        device.type,
    )
    return len(modules)
