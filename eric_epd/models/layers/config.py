"""What every tower reads the same way: its config as a plain dict, and the checkpoint keys no tower loads."""

from __future__ import annotations

from typing import Any

IGNORED_SUFFIXES: tuple[str, ...] = ("rotary_pos_emb.inv_freq",)  # non-persistent buffers some exports contain


def config_to_dict(config: Any) -> dict[str, Any]:
    """A vision config as a plain dict (accepts a dict or a transformers config object)."""
    if isinstance(config, dict):
        return dict(config)
    if hasattr(config, "to_dict"):
        return config.to_dict()
    return dict(vars(config))
