"""CPU sets: `--cpus 0-3,6` parsed once, split among processes, and applied (affinity plus thread counts), so an
Eric and an engine on one host never spin thread pools on the same cores."""

from __future__ import annotations

import os


def parse_cpus(text: str) -> tuple[int, ...]:
    """'0-3,6' -> (0, 1, 2, 3, 6); ValueError naming the problem."""
    cpus: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        first, _, last = part.partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            raise ValueError(f"bad CPU list {text!r}: expected e.g. 0-3,6")
        lo, hi = int(first), int(last or first)
        if hi < lo:
            raise ValueError(f"bad CPU range {part!r} in {text!r}")
        cpus.update(range(lo, hi + 1))
    if not cpus:
        raise ValueError("empty CPU list")
    return tuple(sorted(cpus))


def format_cpus(cpus: tuple[int, ...] | list[int]) -> str:
    """(0, 1, 2, 3, 6) -> '0-3,6' (the form taskset, VLLM_CPU_OMP_THREADS_BIND and --cpus take)."""
    ranges: list[str] = []
    for cpu in sorted(cpus):
        if ranges and "-" in ranges[-1] and int(ranges[-1].split("-")[1]) == cpu - 1:
            ranges[-1] = f"{ranges[-1].split('-')[0]}-{cpu}"
        elif ranges and "-" not in ranges[-1] and int(ranges[-1]) == cpu - 1:
            ranges[-1] = f"{ranges[-1]}-{cpu}"
        else:
            ranges.append(str(cpu))
    return ",".join(ranges)


def available_cpus() -> tuple[int, ...]:
    """The CPUs this process may run on."""
    return tuple(sorted(os.sched_getaffinity(0)))


def split_cpus(cpus: tuple[int, ...], parts: int) -> list[tuple[int, ...]]:
    """`parts` contiguous, near-equal, disjoint slices of `cpus`; with fewer CPUs than parts, slices share CPUs
    round-robin (one each)."""
    if parts < 1:
        raise ValueError("parts must be >= 1")
    if len(cpus) < parts:
        return [(cpus[i % len(cpus)],) for i in range(parts)]
    size, extra = divmod(len(cpus), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        out.append(cpus[start:end])
        start = end
    return out


def pin_process(cpus: tuple[int, ...]) -> None:
    """Run this process (and the threads and children it starts from now on) on `cpus` only."""
    os.sched_setaffinity(0, cpus)


def pin_torch(cpus: tuple[int, ...]) -> int:
    """Pin this process to `cpus` and size torch's intra-op pool to them; returns the thread count."""
    import torch

    pin_process(cpus)
    torch.set_num_threads(len(cpus))
    return len(cpus)
