"""Which test proves EPD for each family Eric serves, through each engine; with what the code serves (modalities,
TP: models/facts.py) it makes the README's family table (`python -m eric_epd.checkpoints.support` prints it;
tests/project/test_family_table.py checks the README and the families the checkpoint builders know against it)."""

from __future__ import annotations

import sys
from dataclasses import dataclass

from eric_epd.common.widths import TOWER_TYPES, is_generic
from eric_epd.models.facts import generic_modalities, serves_tp


@dataclass(frozen=True)
class FamilySupport:
    """One family: its name, its HF model_type, and the test proving EPD through each engine (a test module's
    path), or why there is none (text that is not a path)."""

    name: str
    model_type: str
    vllm: str
    sglang: str

    @property
    def generic(self) -> bool:
        """Served by Eric's generic path (the checkpoint's HF processor, images; transformers' own classes at TP 1
        unless facts.GENERIC_TOWER_TYPES gives it a tower of Eric's own), not a Qwen-style hand-written tower."""
        return is_generic({"model_type": self.model_type})

    @property
    def tp(self) -> str:
        """The README's "Eric TP" cell: 1 and 2 (what the tests run) for a tensor-parallel tower, else 1."""
        return "1, 2" if serves_tp(self.model_type, 2) else "1 (generic path)"

    @property
    def modalities(self) -> tuple[str, ...]:
        """What Eric encodes for it."""
        return generic_modalities(self.model_type) if self.generic else TOWER_TYPES[self.model_type]


NO_SGLANG_GENERIC = (
    "not tested (SGLang 0.5.23 rebuilds an encoder-disaggregated prompt from the encoder's grids "
    "in the Qwen-VL, Kimi, MiMo, InternS1-Pro and MiniMax processors only; this family's falls back "
    "to the generic rebuild, which no test runs against Eric)"
)
GENERIC_VLLM = "tests/vllm/test_generic_families.py"
SGLANG_SERVED = "tests/sglang/test_sglang_server.py"
SGLANG_SERVED_QWEN3 = "tests/sglang/test_sglang_server_qwen3.py"
"""Where real SGLang servers generate tokens through Eric (the other SGLang cells: rows into its real receivers)."""

FAMILY_SUPPORT: tuple[FamilySupport, ...] = (
    FamilySupport("Qwen2-VL", "qwen2_vl", "tests/vllm/test_vllm_plugin.py", SGLANG_SERVED),
    FamilySupport(
        "Qwen2.5-VL", "qwen2_5_vl", "tests/vllm/test_vllm_plugin_qwen25.py", "tests/sglang/test_sglang_adapter.py"
    ),
    FamilySupport("Qwen3-VL", "qwen3_vl", "tests/gateway/test_gateway_qwen3.py", SGLANG_SERVED_QWEN3),
    FamilySupport(
        "Qwen3-VL-MoE", "qwen3_vl_moe", "tests/gateway/test_gateway_qwen3.py", "tests/sglang/test_sglang_families.py"
    ),
    FamilySupport("Qwen3.5", "qwen3_5", "tests/gateway/test_gateway_qwen3.py", "tests/sglang/test_sglang_families.py"),
    FamilySupport(
        "Qwen3.5-MoE",
        "qwen3_5_moe",
        "not tested: vLLM runs Qwen3.5's linear attention on CPU in bfloat16 only ('CPU GDN attention requires BF16'),"
        " where tiny Qwen3.5-MoE's greedy tokens tie at the second step and do not tell another image set's rows from"
        " the right ones (the negative control passes); its tower is Qwen3.5's, proven through vLLM above",
        "tests/sglang/test_sglang_families.py",
    ),
    FamilySupport("Gemma 3", "gemma3", GENERIC_VLLM, NO_SGLANG_GENERIC),
    FamilySupport("Gemma 4", "gemma4", GENERIC_VLLM, NO_SGLANG_GENERIC),
    FamilySupport("InternVL 3 (transformers layout)", "internvl", GENERIC_VLLM, NO_SGLANG_GENERIC),
    FamilySupport("LLaVA-OneVision", "llava_onevision", GENERIC_VLLM, NO_SGLANG_GENERIC),
    FamilySupport("Mistral 3", "mistral3", GENERIC_VLLM, NO_SGLANG_GENERIC),
    FamilySupport("GLM-4.1V", "glm4v", GENERIC_VLLM, NO_SGLANG_GENERIC),
    FamilySupport("GLM-4.5V", "glm4v_moe", GENERIC_VLLM, NO_SGLANG_GENERIC),
    FamilySupport("Idefics3", "idefics3", GENERIC_VLLM, NO_SGLANG_GENERIC),
    FamilySupport("SmolVLM", "smolvlm", GENERIC_VLLM, NO_SGLANG_GENERIC),
    FamilySupport("Llama 4", "llama4", GENERIC_VLLM, NO_SGLANG_GENERIC),
    FamilySupport("Kimi-K2.5", "kimi_k25", GENERIC_VLLM, "tests/sglang/test_sglang_families.py"),
    FamilySupport("Qwen2-Audio", "qwen2_audio", "tests/vllm/test_audio_epd.py", "tests/sglang/test_sglang_audio.py"),
    FamilySupport(
        "Qwen2.5-Omni (thinker)",
        "qwen2_5_omni",
        "tests/vllm/test_omni_epd.py",
        "not supported by SGLang 0.5.23 (`tests/sglang/test_sglang_audio.py`: Eric's audio, image and "
        "video rows reach its receiver, but it has no Qwen2.5-Omni model or processor: with --model-impl "
        "auto its receiver finds no processor, with transformers the fallback's get_mm_data fails)",
    ),
    FamilySupport(
        "Qwen3-Omni-MoE (thinker)",
        "qwen3_omni_moe",
        "tests/vllm/test_omni_epd.py",
        "tests/sglang/test_sglang_qwen3_omni.py",
    ),
)
"""Every family, hand-written towers first."""

TABLE_HEADER = (
    "| family | model_type | image | video | audio | Eric TP | tokens through vLLM | through SGLang |\n"
    "|---|---|---|---|---|---|---|---|"
)


def is_proof(cell: str) -> bool:
    """Whether a proof cell names a test module (else it says why there is none)."""
    return cell.startswith("tests/") and cell.endswith(".py")


def _cell(text: str) -> str:
    return f"`{text}`" if is_proof(text) else text


def family_table() -> str:
    """The README's family table, in Markdown."""
    rows = [
        f"| {f.name} | `{f.model_type}` | "
        + "".join(f"{'yes' if m in f.modalities else 'no'} | " for m in ("image", "video", "audio"))
        + f"{f.tp} | {_cell(f.vllm)} | {_cell(f.sglang)} |"
        for f in FAMILY_SUPPORT
    ]
    return "\n".join([TABLE_HEADER, *rows])


def vllm_proven(path: str) -> list[str]:
    """The model_types whose vLLM proof is the test module at `path`."""
    return [f.model_type for f in FAMILY_SUPPORT if f.vllm == path]


if __name__ == "__main__":
    sys.stdout.write(family_table() + "\n")
