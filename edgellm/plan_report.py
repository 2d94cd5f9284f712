"""`edgellm plan`: a dispatcher Plan as a table, and as a roofline plot."""
from __future__ import annotations

from pathlib import Path

from .costmodel import Unit
from .dispatch import PhasePlan, Placement, Plan
from .errors import ConfigError
from .ops import MATMUL_KINDS

_HEAD = f"  {'op':<12} {'shape':>16} {'MFLOP':>9} {'MB':>8} {'AI':>7} {'unit':<10} {'prec':<5} " \
        f"{'weights':<7} {'bound':<8} {'ms':>8}  reason"


# why TTFT is priced with the placement it is: the one the engine runs the prompt with
_TTFT_PLACEMENT = {"decode": "the decode placement: a one-token prompt runs as a decode step",
                   "prefill_short": "the prefill_short placement: the prompt is one short step",
                   "prefill": "the prefill placement, chunk by chunk"}


def _shape(p: Placement, phase: PhasePlan, by_name) -> str:
    rows = 1 if (p.scope == "model" and p.op != "embedding" and phase.phase == "prefill") else phase.tokens
    op = by_name[p.op]
    return f"{rows}x{op.k}x{op.n}" if p.kind in MATMUL_KINDS else f"{rows}x{op.n}"


def render(plan: Plan, *, model_name: str, soc: str, ops_by_name) -> str:
    out = [f"plan: {model_name} on {plan.device} ({soc}), prompt {plan.prompt_tokens} tokens", "units:"]
    for u in plan.units:
        out.append(f"  {u.name:<10} {'available' if u.available else 'unavailable':<12} {u.reason}")
        for note in u.notes:
            out.append(f"  {'':<10} {'':<12} {note}")
    out.append(f"prefill chunk: {plan.chunk.tokens} tokens")
    out += [f"  {line}" for line in plan.chunk.derivation]
    for key, ph in plan.phases().items():
        if key == "prefill_short":
            what = (f"steps of 2..{plan.short_max_tokens} tokens (a chat turn after a cached prefix), planned "
                    f"at {ph.tokens} tokens at context {ph.context}, where it is predicted faster than the "
                    f"chunk's placement")
        elif ph.phase == "prefill":
            what = f"a chunk of {ph.tokens} tokens at context {ph.context}"
        else:
            what = f"one token at context {ph.context}"
        out.append(f"{key}: {what}; layer ops run x{ph.n_layers}, predicted {ph.step_ms:.2f} ms per step")
        out.append(_HEAD)
        for p in ph.placements:
            weights = p.weight_format + ("*" if p.by_layer.startswith("weights") else "")
            out.append(f"  {p.op:<12} {_shape(p, ph, ops_by_name):>16} {p.flops / 1e6:>9.2f} {p.bytes / 1e6:>8.3f} "
                       f"{p.intensity:>7.1f} {p.unit:<10} {p.precision:<5} {weights:<7} {p.bound:<8} "
                       f"{p.predicted_ms:>8.4f}  {p.reason}")
        mixed = [p for p in ph.placements if p.by_layer]
        if mixed:   # (the row shows the most layers' weights, marked *, and compute as "int8+fp32")
            out.append("  by layer:")
            out += [f"    {p.op:<12} {p.by_layer}" for p in mixed]
    for w in plan.warnings:
        out.append(f"warning: {w}")
    out.append(f"predicted: TTFT {plan.predicted_ttft_ms:.1f} ms for {plan.prompt_tokens} prompt tokens "
               f"({_TTFT_PLACEMENT[plan.ttft_phase]}), decode {plan.predicted_decode_tps:.1f} tok/s")
    return "\n".join(out)


def plot(plan: Plan, path: str, *, title: str) -> None:
    """Each available unit's roofline (attainable FLOP/s against arithmetic intensity, at its
    main precision) with the plan's ops as points: filled for prefill, hollow for decode."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'edgellm[plot]'") from None
    import numpy as np

    units = [u for u in plan.units if u.available and u.peak]
    colours = {u.name: c for u, c in zip(units, ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple"))}
    fig, ax = plt.subplots(figsize=(10, 6.5), dpi=110)
    ai = np.logspace(-2, 3.5, 200)
    for u, dash in zip(units, ("-", "--", "-.", ":", (0, (5, 1)))):
        prec, peak = _main_peak(u)
        # units that share DRAM share the slanted part: dashes keep each one visible
        ax.plot(ai, np.minimum(peak, ai * u.bandwidth) / 1e9, color=colours[u.name], lw=2, ls=dash, alpha=0.8,
                label=f"{u.name} roof ({prec} {peak / 1e9:.0f} GFLOP/s, {u.bandwidth / 1e9:.1f} GB/s)")
    offsets = iter([(12, 8), (12, -14), (-70, 16), (12, 26), (-60, -24), (12, -30)] * 4)   # stagger close labels
    for ph, fill in ((plan.prefill, True), (plan.decode, False)):
        for p in ph.placements:
            if p.flops <= 0 or p.unit not in colours:
                continue
            attained = p.flops / ((p.predicted_ms - p.transfer_ms) * 1e-3) / 1e9
            c = colours[p.unit]
            ax.scatter(p.intensity, attained, s=40, edgecolors=c, facecolors=c if fill else "none", zorder=3)
            if ph.phase == "prefill" and (p.kind in MATMUL_KINDS or p.op == "attention"):
                ax.annotate(f"{p.op} ({ph.phase[0]})", (p.intensity, attained), fontsize=7,
                            xytext=next(offsets), textcoords="offset points",
                            arrowprops={"arrowstyle": "-", "lw": 0.4, "alpha": 0.6})
    dec = [p for p in plan.decode.placements if p.kind in MATMUL_KINDS and p.op != "lm_head"]
    if dec:   # decode matmuls sit together on the bandwidth slope: one label for the group
        p = max(dec, key=lambda p: p.flops)
        ax.annotate("decode matmuls", (p.intensity, p.flops / ((p.predicted_ms - p.transfer_ms) * 1e-3) / 1e9),
                    fontsize=7, xytext=(8, -26), textcoords="offset points",
                    arrowprops={"arrowstyle": "-", "lw": 0.5})
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("attained GFLOP/s (predicted)")
    ax.set_title(f"{title}\nfilled: prefill chunk of {plan.prefill.tokens} tokens; hollow: decode step")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    import io

    from .fileio import write_atomic

    buf = io.BytesIO()   # (saved in place, a failed write left a good plot cut short, or an empty file)
    try:
        fig.savefig(buf, format=Path(path).suffix.lstrip(".").lower() or "png")
        write_atomic(path, buf.getvalue(), mode=0o644)
    except OSError as e:
        raise ConfigError(f"--plot {path}: cannot write: {e.strerror or e}") from None
    finally:
        plt.close(fig)


def _main_peak(u: Unit) -> tuple[str, float]:
    prec = u.quant_precision if u.peak.get(u.quant_precision) else "fp32"
    peak = max(f for _, f in u.gemm_curve) if (u.gemm_curve and prec == u.curve_precision) else u.peak.get(prec, 0.0)
    return prec, peak
