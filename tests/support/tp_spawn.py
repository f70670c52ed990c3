"""Where the tests' spawned TP ranks meet: a file rendezvous in the test's own directory (as Eric's workers meet),
so no TCP port is picked, raced for or listened on."""

from __future__ import annotations

from pathlib import Path


def rendezvous(directory: str | Path) -> str:
    """torch.distributed's init_method for ranks spawned by one test: a file no other test shares (it must not
    exist yet; the last rank to leave removes it)."""
    path = Path(directory) / "tp-rendezvous"
    path.unlink(missing_ok=True)
    return f"file://{path}"
