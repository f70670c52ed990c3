"""The README's figures on Eric's host side and its repeats, as each benchmark's JSON states them: host_path (per core
against vLLM's processor, transformers' and decoding alone), eric_repeat (a resent image against a first sight) and the
bfloat16 tower on a CPU with bfloat16 units (encoder_throughput_amx)."""

from __future__ import annotations

from tests.support.readme_figures import f2, span, x

PATHS = ("decode", "eric", "vllm", "hf_fast", "hf_slow")
NAMES = {"jpeg": "JPEG", "png": "PNG", "video": "video"}


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.3g}" if v >= 10 else f2(v)


def host_path(d: dict) -> str:
    """Each set's ms per item along the paths, Eric's ratios and the verdict."""
    cells = []
    for row in d["table"]:
        kind, side = row["set"].split("_")
        label = NAMES[kind] if kind == "video" else f"{NAMES[kind]} {side}"
        cells.append(f"{label} " + " / ".join(_ms(row["ms_per_item"][p]) for p in PATHS))
    vs_vllm, vs_decode = _ratios(d)
    met = all(r["vs_vllm_met"] and r["vs_decode_met"] for r in d["table"])
    verdict = "met" if met else "**not met**"
    return (
        f"ms per item, decode / Eric / vLLM / HF fast / HF slow: {'; '.join(cells)}. Eric vs vLLM {vs_vllm}; Eric / "
        f"decode {vs_decode} | Eric >= 2x vLLM's processor per core on every set and within 1.3x of decode alone: "
        f"{verdict}"
    )


def host_path_brief(d: dict) -> str:
    """Eric's ratios and its ms per item at 1024 px: how a run of other code compares."""
    rows = {r["set"]: r for r in d["table"]}
    vs_vllm, vs_decode = _ratios(d)
    at_1024 = ", ".join(f"{NAMES[k]} {_ms(rows[f'{k}_1024']['ms_per_item']['eric'])} ms" for k in ("jpeg", "png"))
    return f"Eric vs vLLM {vs_vllm}, Eric / decode {vs_decode}; Eric at 1024 px: {at_1024}"


def _ratios(d: dict) -> tuple[str, str]:
    """The spans of Eric's speed-up over vLLM and of its cost over decoding alone, over the sets."""
    return (
        span([r["eric_speedup_vs_vllm"] for r in d["table"]], x),
        span([r["eric_over_decode"] for r in d["table"]], x),
    )


def host_cpu(d: dict) -> str:
    """The CPU the host-path run measured, with its vector ISA."""
    cpu = d["config"]["cpu"]
    isa = "AVX-512" if cpu["avx512f"] else "AVX2" if cpu["avx2"] else "neither AVX2 nor AVX-512"
    flags = cpu["avx512_amx_flags"]
    extra = (
        " and AMX"
        if any(f.startswith("amx") for f in flags)
        else " (AVX512-BF16, no AMX)"
        if "avx512_bf16" in flags
        else ""
    )
    return f"this CPU: {cpu['model_name']} with {isa}{extra}"


def repeat(d: dict) -> str:
    """Per set, Eric's CPU ms per image at first sight and when resent (alias on) and the ratio; the ratios with the
    alias off; where the 20x target is met."""
    cells = [
        f"{r['set'].replace('_', ' ')} {_first(r['first_ms_alias_run'])} / {r['resend_ms_alias']:.2g} ms "
        f"({r['ratio_alias']:.0f}x)"
        for r in d["table"]
    ]
    off = span([r["ratio_no_alias"] for r in d["table"]], x)
    met = [r["set"].replace("_", " ") for r in d["table"] if r["target_met"]]
    return (
        f"{d['config']['model']}: {'; '.join(cells)}; with the alias off {off}; 20x met on "
        f"{', '.join(met) if met else 'none'}"
    )


def gemm_rates(d: dict) -> str:
    """The recorded CPU's matmul rates per dtype (one core), as the run measured them."""
    flops = d["matmul_flops"]
    return f"bfloat16 GEMMs at {flops['bfloat16'] / 1e9:.0f} against {flops['float32'] / 1e9:.0f} GFLOP/s in float32"


def _first(v: float) -> str:
    return f"{v:.0f}" if v >= 100 else f"{v:.3g}"


def bf16_tower(d: dict) -> str:
    """bf16_ratios, and the verdict."""
    met = min(d["bfloat16_over_float32"].values()) >= 3
    return f"{bf16_ratios(d)} | >= 3x: {'met' if met else '**not met**'}"


def bf16_ratios(d: dict) -> str:
    """Eric's bfloat16 images/s over its float32 images/s per workload on the recorded CPU, and the fractions of each
    dtype's GEMM ceiling it reaches."""
    ratios = d["bfloat16_over_float32"]
    flags = [f for f in d["cpu"]["avx512_amx_flags"] if f in ("amx_bf16", "avx512_bf16")]
    ceiling = {t: span([r["eric"]["fraction_of_gemm_ceiling"] for r in d["runs"][t].values()]) for t in d["runs"]}
    return (
        "bfloat16 / float32 images/s: "
        + ", ".join(f"{w} {x(v)}" for w, v in ratios.items())
        + f" (CPU flags {', '.join(flags)}); Eric reaches {ceiling['bfloat16']} of the bfloat16 GEMM ceiling against "
        f"{ceiling['float32']} in float32"
    )


def repeat_sglang(d: dict) -> str:
    """Per set, Eric's on-CPU ms per image beyond its idle burn through SGLang's protocol, first sight and resent
    (alias on), and the ratio; the raw ratios (idle burn included) and where the 20x target is met net of it."""
    t = d["table"]
    net = [r["first_net_ms_alias_run"] / r["resend_net_ms_alias"] for r in t]
    cells = [
        f"{r['set'].replace('_', ' ')} {r['first_net_ms_alias_run']:.3g} / {r['resend_net_ms_alias']:.2g} ms ({n:.0f}x)"
        for r, n in zip(t, net, strict=True)
    ]
    met = [r["set"].replace("_", " ") for r, n in zip(t, net, strict=True) if n >= d["target_ratio"]]
    return (
        f"{d['config']['model']}, beyond Eric's idle burn ({t[0]['idle_cpu_s_per_s']:.2%} of a core over "
        f"{span([r['resend_wall_ms_per_image'] for r in t], lambda v: f'{v:.0f}')} ms of SGLang's wall time per "
        f"resent image): {'; '.join(cells)}; with the alias off the resends cost "
        f"{span([r['resend_net_ms_no_alias'] for r in t], lambda v: f'{v:.2g}')} ms; idle burn included "
        f"{span([r['ratio_alias'] for r in t], x)}; 20x met on {', '.join(met) if met else 'none'}"
    )
