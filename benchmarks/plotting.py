"""The one chart the benchmarks draw: labelled horizontal bars, lower is better. Every measured plot's
title names the machine (common.machine.machine_name; where_measured says it for a title)."""


def where_measured(gpus: bool = False) -> str:
    """'on one <machine>' for a plot title: the GPU (and how many) when the runs use GPUs and CUDA is
    there, the CPU otherwise."""
    import torch

    from common.machine import machine_name
    if gpus and torch.cuda.is_available():
        count, name = torch.cuda.device_count(), machine_name(torch.device("cuda", 0))
        return f"on {count} x {name}" if count > 1 else f"on one {name}"
    return f"on one {machine_name()}"


def finish(fig, path: str, title: str | None = None) -> None:
    """Title the figure (the machine, as a rule), lay it out and save it as a PNG."""
    if title is not None:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"saved {path}")


def bar_chart(values: dict[str, float], annotations: list[str], xlabel: str, title: str, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 0.5 + 0.55 * len(values)))
    bars = ax.barh(list(values), list(values.values()), color="#1f77b4")
    labels = ax.bar_label(bars, annotations, padding=3)
    ax.invert_yaxis()
    ax.set_xlim(0, max(values.values()) * 1.05)
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    fit_labels(fig, ax, labels)
    fit_title(fig, ax)
    fig.savefig(path, dpi=120)
    print(f"saved {path}")


def fit_title(fig, ax) -> None:
    """Wrap a title that runs off the figure (a long machine name) onto more lines; call it once the
    layout is done, since the title is centred over the axes, not the figure."""
    import textwrap
    text = ax.title.get_text()
    chars = max(map(len, text.splitlines()))
    for _ in range(8):
        box = ax.title.get_window_extent(fig.canvas.get_renderer())
        if box.x0 >= 0 and box.x1 <= fig.bbox.width:
            return
        chars = max(20, int(chars * 0.85))
        ax.title.set_text("\n".join(wrapped for line in text.splitlines() for wrapped in textwrap.wrap(line, chars)))
        fig.tight_layout()


def fit_labels(fig, ax, labels) -> None:
    """Widen the x axis until every label beside a bar ends inside it: a label's length is text, not
    data, so a fixed margin clips long ones."""
    for _ in range(5):
        fig.tight_layout()
        right = max(label.get_window_extent(fig.canvas.get_renderer()).x1 for label in labels)
        lo, hi = ax.get_xlim()
        needed = ax.transData.inverted().transform((right, 0))[0]
        if needed <= hi:
            return
        ax.set_xlim(lo, lo + (needed - lo) * 1.04)


def stacked_memory_chart(rows, runs: list[str], title: str, path: str) -> None:
    """Bytes per rank as stacked bars (parameters, gradients, optimizer state), one group per world size,
    with the formula's total as a line over each bar and the measured peak as a dot.

    rows: (world size, run, measured dict with params/grads/optimizer/peak_mb, formula (params, grads, optimizer))
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    world_sizes = sorted({row[0] for row in rows})
    fig, ax = plt.subplots(figsize=(max(8, 1.9 * len(world_sizes) * len(runs) / 4), 5))
    width, gap = 0.8, 1.0
    ticks, labels = [], []
    for group, world_size in enumerate(world_sizes):
        for index, run in enumerate(runs):
            measured, formula = next((m, f) for n, r, m, f in rows if n == world_size and r == run)
            x = group * (len(runs) + gap) + index
            bottom = 0.0
            for key, color, name in (("params", "#1f77b4", "parameters"), ("grads", "#ff7f0e", "gradients"),
                                     ("optimizer", "#2ca02c", "optimizer state")):
                ax.bar(x, measured[key] / 2**20, width, bottom=bottom, color=color,
                       label=name if (group, index) == (0, 0) else None)
                bottom += measured[key] / 2**20
            ax.hlines(sum(formula) / 2**20, x - width / 2, x + width / 2, colors="black",
                      label="formula (4Ψ + 4Ψ + 8Ψ, sharded terms / N)" if (group, index) == (0, 0) else None)
            if measured["peak_mb"] is not None:
                ax.plot(x, measured["peak_mb"], "o", color="#d62728", markersize=4,
                        label="peak above start (RSS)" if (group, index) == (0, 0) else None)
            ticks.append(x)
            labels.append(run)
        middle = group * (len(runs) + gap) + (len(runs) - 1) / 2
        ax.text(middle, -0.2, f"N = {world_size}", transform=ax.get_xaxis_transform(), ha="center", va="top", fontsize=9)
    ax.set_xticks(ticks, labels, fontsize=7, rotation=90)  # upright, five names per group collide
    ax.set_ylabel("MiB per rank (lower is better)")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))  # outside: inside it hid the N=4 peaks
    fig.tight_layout()
    fit_title(fig, ax)
    fig.savefig(path, dpi=120)
    print(f"saved {path}")
