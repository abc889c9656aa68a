"""What a local run shows: the one-line description of its pipelines, a progress bar that
follows progress.json while it trains, and at the end the loss curve (`loss.png`), the
summary (`summary.json`) and its printed form."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from relaytrain_contract import Progress

from relaytrain_operator.cli.local_run.layout import Layout
from relaytrain_operator.cli.local_run.stages import StageProc

if TYPE_CHECKING:
    from relaytrain_operator.cli.local_run.supervisor import LocalRun


def on_gpus(stages: Sequence[StageProc]) -> str:
    """`, on GPUs: stage 0 on 0, stage 1 on 1`, or nothing when no stage has a GPU of its own."""
    placed = [f"{s.name} on {s.gpu}" for s in stages if s.gpu is not None]
    return f", on GPUs: {', '.join(placed)}" if placed else ""


def describe(layout: Layout) -> str:
    """`2 stages (layers 0-1, 2-3)`, or per pipeline with its micro-batches."""

    def one(split: list[tuple[int, int]]) -> str:
        return f"{len(split)} stages (layers {', '.join(f'{a}-{b - 1}' for a, b in split)})"

    if len(layout.splits) == 1:
        return one(layout.splits[0])
    return f"{len(layout.splits)} pipelines: " + "; ".join(
        f"p{p} {one(split)} x {share} micro-batch{'' if share == 1 else 'es'}"
        for p, (split, share) in enumerate(zip(layout.splits, layout.shares, strict=True))
    )


def progress_bar(show: bool) -> Any:
    """A tqdm bar of steps (None: no bar)."""
    if not show:
        return None
    from tqdm import tqdm

    return tqdm(total=None, unit="step", dynamic_ncols=True)


def show_progress(bar: Any, progress: Progress) -> None:
    """Move `bar` to `progress`: step of total steps, loss, tokens/s, last checkpoint and
    the held-out loss when there is one."""
    bar.total = progress.total_steps
    bar.n = progress.step
    loss = progress.loss
    bar.set_postfix(
        loss=f"{loss:.4f}" if loss is not None else "-",
        tok_s=f"{progress.tokens_per_second:.0f}",
        ckpt=progress.last_committed_step,
        **({"eval": f"{progress.eval_loss:.4f}"} if progress.eval_loss is not None else {}),
    )
    bar.refresh()


def loss_png(losses: list[dict[str, Any]], out: Path) -> bool:
    """Plot the loss history to `out`; False without matplotlib (nothing written)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 3.5))
    trained = [e for e in losses if e.get("loss") is not None]
    ax.plot([e["step"] for e in trained], [e["loss"] for e in trained], marker=".",
            label="training")  # fmt: skip
    held = [e for e in losses if e.get("evalLoss") is not None]
    if held:  # the held-out loss (dataset.validation), step 0 being the base model's
        ax.plot([e["step"] for e in held], [e["evalLoss"] for e in held], marker="o",
                label="held-out")  # fmt: skip
        ax.legend()
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return True


def finish(run: LocalRun, started: float) -> None:
    """After a successful run: write `loss.png` and `summary.json` into its state directory
    and print the summary. `started`: time.monotonic() when the run began."""
    losses = run.read_json("loss-history.json") or []
    png = run.workdir / "loss.png"
    have_png = bool(losses) and loss_png(losses, png)
    final = run.read_progress()
    held = [e["evalLoss"] for e in losses if e.get("evalLoss") is not None]
    summary = {
        "job": run.job.metadata.name,
        "stages": len(run.stages),
        "pipelines": [
            {"stages": len(split), "layers": [list(r) for r in split], "microBatches": share}
            for split, share in zip(run.layout.splits, run.layout.shares, strict=True)
        ],
        "steps": final.step if final else None,
        "finalLoss": final.loss if final else None,
        "firstLoss": next((e["loss"] for e in losses if e.get("loss") is not None), None),
        **({"firstEvalLoss": held[0], "evalLoss": held[-1]} if held else {}),
        "tokensPerSecond": final.tokens_per_second if final else None,
        "restarts": {
            (s.index if len(run.layout.splits) == 1 else f"p{s.pipeline}/s{s.index}"): s.restarts
            for s in run.stages
            if s.restarts
        },
        **({"pipelineChanges": run.changes} if run.changes else {}),
        "output": (final.output if final else None) or run.output,
        "lossCurve": str(png) if have_png else None,
        "wallSeconds": round(time.monotonic() - started, 1),
    }
    (run.workdir / "summary.json").write_text(json.dumps(summary, indent=2))
    print("relaytrain: done")
    for key, value in summary.items():
        print(f"  {key:16} {value}")
