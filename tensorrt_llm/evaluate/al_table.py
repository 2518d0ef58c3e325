"""The AL table: {target only, Eagle3 separate, Eagle3 unified} x {cold first turn, reused turns 2-4}.

Every mode runs the same held-out gsm8k-tiny problems and multiturn-copy conversations, greedily.
Speculation is lossless, so the target's outputs must be identical in every cell; the table says
whether they were. Each extra KV dtype (``kv_dtypes``, e.g. ``fp8``) adds rows of its own: target
only, the unified drafters and (with deployments) Eagle3 unified disaggregated, whose outputs must
equal that dtype's target-only outputs (speculation is lossless at the same KV dtype). Writes ``al_table.md``, ``al_table.json`` and ``al_per_turn.png`` to ``out_dir``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from tensorrt_llm.evaluate.runner import (
    run_gsm8k,
    run_gsm8k_http,
    run_multiturn_copy,
    run_multiturn_copy_http,
)

MODES = (("target only", None), ("Eagle3 separate", "separate"), ("Eagle3 unified", "unified"))
# rows of a target that carries its own MTP module
MTP_MODES = (("MTP separate", "mtp-separate"), ("MTP unified", "mtp-unified"))


def build_al_table(
    make_llm: Callable[..., object],
    num_gsm8k: int,
    num_conversations: int,
    out_dir: Path,
    progress: Callable[[str], None] = print,
    settings: dict | None = None,
    deployment_options: Callable[..., dict] | None = None,
    mtp: bool = False,
    tool_use: bool = False,
    kv_dtypes: tuple[str, ...] = (),
) -> dict:
    """``make_llm(mode, kv_dtype="auto")`` builds an LLM for a draft KV mode (None: no
    speculation); ``settings`` (tokens per block, draft length, device) are recorded with the
    results. With ``deployment_options(mode, kv_dtype="auto")`` (the servers' LLM options) every
    mode also runs disaggregated: a router, a context and a generation server started on loopback,
    driven over HTTP. ``mtp``: the target's MTP module drafts in rows of its own too.
    ``tool_use`` (a checkpoint that speaks MiniMax-M3's protocol): each mode also runs the
    tool-use task (``m3_runner``, adaptive mode; aggregated only), its accuracy and AL in the
    row. ``kv_dtypes``: the extra rows' KV dtypes (module docstring)."""
    modes = MODES + (MTP_MODES if mtp else ())
    results, outputs, tool_outputs = {}, {}, {}
    table = _Table(results, outputs, tool_outputs, num_gsm8k, num_conversations, progress)
    device = (settings or {}).get("device", "cpu")
    for label, mode in modes:
        table.run(label, make_llm(mode), tool_use)
        if deployment_options is not None:
            table.run_disaggregated(f"{label}, disaggregated", deployment_options(mode), device)
    groups = {"auto": [label for label in results]}
    for dtype in kv_dtypes:
        groups[dtype] = []
        for label, mode in modes:
            if mode is None or "unified" in mode:
                groups[dtype].append(f"{label}, {dtype} KV")
                table.run(groups[dtype][-1], make_llm(mode, dtype), tool_use)
        if deployment_options is not None:
            groups[dtype].append(f"Eagle3 unified, {dtype} KV, disaggregated")
            options = deployment_options("unified", dtype)
            table.run_disaggregated(groups[dtype][-1], options, device)
    identical = {
        dtype: all(outputs[label] == outputs[labels[0]] for label in labels)
        and all(
            tool_outputs[label] == tool_outputs[labels[0]]
            for label in labels[1:]
            if label in tool_outputs
        )
        for dtype, labels in groups.items()
    }
    unified, separate = results["Eagle3 unified"], results["Eagle3 separate"]
    summary = {
        "modes": results,
        "outputs_identical_in_every_mode": all(identical.values()),
        "outputs_identical_per_kv_dtype": identical,
        "unified_reused_minus_cold": unified["reused_al"] - unified["cold_al"],
        "unified_minus_separate_reused": unified["reused_al"] - separate["reused_al"],
        "disaggregated_minus_aggregated_gsm8k_al": {
            label: results[f"{label}, disaggregated"]["gsm8k_al"] - results[label]["gsm8k_al"]
            for label, _ in modes
            if f"{label}, disaggregated" in results
        },
        "num_gsm8k": num_gsm8k,
        "num_conversations": num_conversations,
        "settings": settings or {},
    }
    if mtp:
        unified, separate = results["MTP unified"], results["MTP separate"]
        summary["mtp_unified_reused_minus_cold"] = unified["reused_al"] - unified["cold_al"]
        summary["mtp_unified_minus_separate_reused"] = unified["reused_al"] - separate["reused_al"]
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "al_table.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out_dir / "al_table.md").write_text(markdown(summary))
    plot(summary, out_dir / "al_per_turn.png")
    progress(markdown(summary))
    return summary


class _Table:
    """Runs rows into the results, the replies and the tool-use replies, by row label."""

    def __init__(self, results, outputs, tool_outputs, num_gsm8k, num_conversations, progress):
        self.results, self.outputs, self.tool_outputs = results, outputs, tool_outputs
        self.num_gsm8k, self.num_conversations, self.progress = (
            num_gsm8k,
            num_conversations,
            progress,
        )

    def run(self, label: str, llm, tool_use: bool) -> None:
        self.progress(f"== {label}")
        gsm8k = run_gsm8k(llm, self.num_gsm8k, self.progress)
        turns = run_multiturn_copy(llm, self.num_conversations, self.progress)
        self.results[label] = _row(gsm8k, turns)
        self.outputs[label] = [gsm8k["texts"]] + [t.texts for t in turns]
        if tool_use:
            row, self.tool_outputs[label] = _tool_use(llm, self.num_gsm8k, self.progress)
            self.results[label].update(row)
        llm.shutdown()

    def run_disaggregated(self, label: str, options: dict, device: str) -> None:
        self.progress(f"== {label}")
        self.results[label], self.outputs[label] = _disaggregated(
            options, device, self.num_gsm8k, self.num_conversations, self.progress
        )


def _tool_use(llm, count: int, progress) -> tuple[dict, list[str]]:
    """The tool-use task's row fields (adaptive mode) and its replies."""
    from tensorrt_llm.evaluate.m3_runner import run_tool_use

    tools = run_tool_use(llm, count, "adaptive", progress)
    row = {
        "tool_calls_right": tools["calls_right"],
        "tool_answers_right": tools["answers_are_the_tools"],
        "tool_use_al": tools["al"],
    }
    return row, tools["texts"]


def _disaggregated(options: dict, device: str, num_gsm8k: int, num_conversations: int, progress):
    """A mode's row and replies through a router, a context and a generation server."""
    from tensorrt_llm.evaluate.deployment import disaggregated_deployment

    with disaggregated_deployment(options, device=device) as urls:
        gsm8k = run_gsm8k_http(urls["router"], num_gsm8k, progress)
        turns = run_multiturn_copy_http(urls["router"], num_conversations, urls["ctx"], progress)
    return _row(gsm8k, turns), [gsm8k["texts"]] + [t.texts for t in turns]


def _row(gsm8k: dict, turns: list) -> dict:
    return {
        "gsm8k_accuracy": gsm8k["accuracy"],
        "gsm8k_al": gsm8k["al"],
        "copy_al_per_turn": [t.al for t in turns],
        "copy_exact_per_turn": [t.exact for t in turns],
        "copy_reused_tokens_per_turn": [t.reused_tokens for t in turns],
        "cold_al": turns[0].al,
        "reused_al": sum(t.al for t in turns[1:]) / 3,
    }


def markdown(summary: dict) -> str:
    tools = any("tool_use_al" in r for r in summary["modes"].values())
    rows = [
        "| mode | gsm8k-tiny accuracy | gsm8k-tiny AL (cold) | multiturn-copy AL, cold turn 1 | multiturn-copy AL, reused turns 2-4 |"
        + (" tool use: calls right | tool-use AL |" if tools else ""),
        "| --- | --- | --- | --- | --- |" + (" --- | --- |" if tools else ""),
    ]
    for label, r in summary["modes"].items():
        row = f"| {label} | {r['gsm8k_accuracy']:.2%} | {r['gsm8k_al']:.2f} | {r['cold_al']:.2f} | {r['reused_al']:.2f} |"
        if tools:
            row += (
                f" {r['tool_calls_right']:.2%} | {r['tool_use_al']:.2f} |"
                if "tool_use_al" in r
                else " - | - |"
            )
        rows.append(row)
    rows += [
        "",
        f"Target outputs identical in every mode: {'yes' if summary['outputs_identical_in_every_mode'] else 'NO'}"
        + (
            " (rows of one KV dtype against that dtype's target only)."
            if len(summary.get("outputs_identical_per_kv_dtype", {})) > 1
            else "."
        ),
        f"Unified, reused minus cold: {summary['unified_reused_minus_cold']:+.2f}. "
        f"Unified minus separate on reused turns: {summary['unified_minus_separate_reused']:+.2f}.",
        *(
            [
                f"MTP unified, reused minus cold: {summary['mtp_unified_reused_minus_cold']:+.2f}. "
                "MTP unified minus separate on reused turns: "
                f"{summary['mtp_unified_minus_separate_reused']:+.2f}."
            ]
            if "mtp_unified_reused_minus_cold" in summary
            else []
        ),
        *(
            [
                "Disaggregated minus aggregated gsm8k-tiny AL: "
                + ", ".join(
                    f"{k} {v:+.2f}"
                    for k, v in summary["disaggregated_minus_aggregated_gsm8k_al"].items()
                )
                + "."
            ]
            if summary["disaggregated_minus_aggregated_gsm8k_al"]
            else []
        ),
        f"({summary['num_gsm8k']} gsm8k-tiny problems, {summary['num_conversations']} four-turn conversations, greedy; "
        + ", ".join(f"{k}={v}" for k, v in summary["settings"].items())
        + ".)",
        "Prompt tokens served from the prefix cache per multiturn-copy turn (unified): "
        + ", ".join(
            str(n) for n in summary["modes"]["Eagle3 unified"]["copy_reused_tokens_per_turn"]
        )
        + ".",
        "",
    ]
    return "\n".join(rows)


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    for i, (label, r) in enumerate(summary["modes"].items()):
        style = "--" if "disaggregated" in label else "-"
        color = f"C{[name for name, _ in MODES + MTP_MODES].index(label.split(',')[0])}"
        style = ":" if " KV" in label else style
        ax.plot(
            [1, 2, 3, 4],
            r["copy_al_per_turn"],
            style,
            marker="o",
            color=color,
            label=label,
            alpha=0.9 - 0.1 * (i % 2),
        )
    reused = summary["modes"]["Eagle3 unified"]["copy_reused_tokens_per_turn"]
    ax.set_xticks(
        [1, 2, 3, 4], [f"{t}\n({n} reused)" for t, n in zip([1, 2, 3, 4], reused, strict=True)]
    )
    ax.set_xlabel("multiturn-copy turn (prompt tokens from the prefix cache)")
    ax.set_ylabel("acceptance length (AL)")
    ax.set_ylim(0.8, 4.2)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower left", fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
