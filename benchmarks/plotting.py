"""The one chart the benchmarks draw: labelled horizontal bars, lower is better."""


def bar_chart(values: dict[str, float], annotations: list[str], xlabel: str, title: str, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 0.5 + 0.55 * len(values)))
    bars = ax.barh(list(values), list(values.values()), color="#1f77b4")
    ax.bar_label(bars, annotations, padding=3)
    ax.invert_yaxis()
    ax.set_xlim(0, max(values.values()) * 1.35)
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"saved {path}")
