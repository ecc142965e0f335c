"""``meshd bench --plot``: decode tokens/s by arm and workload (matplotlib, optional)."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .workloads import BenchError


def check_plot_available() -> None:
    try:
        importlib.import_module("matplotlib")
    except ImportError as exc:
        raise BenchError(
            "--plot needs matplotlib, which is an optional extra: "
            "pip install 'meshd[plot]' (or pip install matplotlib)"
        ) from exc


def write_plot(report: Mapping[str, Any], path: Path) -> None:
    """Median decode tokens/s by arm and workload, one panel per model."""
    # Imported by name: matplotlib is an optional extra (and has no stubs installed).
    matplotlib: Any = importlib.import_module("matplotlib")
    matplotlib.use("Agg")
    plt: Any = importlib.import_module("matplotlib.pyplot")

    models = report["models"]
    # One colour per arm across every panel, so an arm reads the same everywhere.
    every_arm = list(dict.fromkeys(
        a for m in models for w in m["workloads"] for a in w["arms"]))
    fig, axes = plt.subplots(len(models), 1, figsize=(11, 3.6 * len(models)), squeeze=False)
    for ax, m in zip(axes[:, 0], models, strict=True):
        workloads = [w["name"] for w in m["workloads"]]
        arms = [a for a in every_arm if any(a in w["arms"] for w in m["workloads"])]
        width = 0.8 / max(1, len(arms))
        for j, arm in enumerate(arms):
            values = [(w["arms"].get(arm) or {}).get("median_decode_tok_s") or 0.0
                      for w in m["workloads"]]
            xs = [i + (j - (len(arms) - 1) / 2) * width for i in range(len(workloads))]
            ax.bar(xs, values, width, label=arm, color=f"C{every_arm.index(arm) % 10}")
        ax.set_xticks(range(len(workloads)), workloads)
        ax.set_ylabel("decode tokens/s (median)")
        ax.set_title(str(m["name"]))
        ax.legend(fontsize="small", ncol=4)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
