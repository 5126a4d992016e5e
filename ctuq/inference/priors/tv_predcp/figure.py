"""The trace figure of the TV-PredCP type-II MAP (``tv_predcp_trace.png`` in a run folder)."""

from __future__ import annotations

from pathlib import Path

from ctuq.utils import atomic_path

__all__ = ["plot_prior_trace"]


def plot_prior_trace(path: str | Path, trace: list[dict], dpi: int = 120) -> Path:
    """The type-II MAP trace (:func:`~.fit.fit_block_prior` records) against step: lengthscales ``ℓ_b``, variances
    ``σ²_b`` (log axes), ``σ²``, the data fit ``−½ỹᵀC⁻¹ỹ`` and the log hyperprior, as a PNG written atomically.
    Returns ``path``.

    Drawn with matplotlib's ``Figure`` directly (as :mod:`ctuq.figures` does) rather than through
    :mod:`ctuq.figures`, whose import pulls the metrics package (and through :mod:`ctuq.outputs` the CT geometry) into
    the inference core; matplotlib itself is imported here, when a figure is drawn, so importing the core does not
    import it."""
    from matplotlib.figure import Figure

    path = Path(path)
    steps = [r["step"] for r in trace]
    panels = [
        ("lengthscale", "lengthscales ℓ_b", True),
        ("variance", "variances σ²_b", True),
        ("sigma2", "noise σ²", True),
        ("data_fit", "−½ ỹᵀC⁻¹ỹ", False),
        ("log_hyperprior", "log p_TV(ℓ)", False),
    ]
    fig = Figure(figsize=(3.2 * len(panels), 3.0), dpi=dpi, layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (key, label, log) in zip(axes, panels):
        ax.plot(steps, [r[key] for r in trace], lw=1)
        if log:
            ax.set_yscale("log")
        ax.set(title=label, xlabel="step")
        ax.grid(alpha=0.3)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=fig.dpi)
    return path
