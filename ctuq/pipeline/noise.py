"""The noise model of a CT run: ``uq.noise`` resolved once against the scan (:func:`resolve_noise` →
:class:`ResolvedNoise`, recorded in ``metrics.json["uq"]["stats"]["noise"]``), and the likelihood it builds.

``homoscedastic``: ``ε ~ N(0, σ² I)``. ``per_ray``: ``ε ~ N(0, σ² D)``
(:class:`~ctuq.inference.likelihoods.DiagonalGaussianLikelihood`), ``D`` the scan's per-measurement variances from
the photon statistics (:attr:`ctuq.data.CTData.variances`, data units²) normalised to mean 1, so ``σ²`` stays the
mean noise variance in scaled units; the likelihood carries ``D`` and its normaliser and answers the noise variance
of the scan's held-out rows itself (``noise_variance_of``). ``auto`` (the default) is ``per_ray`` when the scan has
usable variances, else ``homoscedastic``.
"""

from __future__ import annotations

import dataclasses

import torch

from ctuq.config import UQConfig
from ctuq.errors import CTUQError
from ctuq.inference import GaussianLikelihood
from ctuq.inference.likelihoods import DiagonalGaussianLikelihood
from ctuq.options import NoiseModel

__all__ = ["ResolvedNoise", "resolve_noise"]


@dataclasses.dataclass(frozen=True)
class ResolvedNoise:
    """The noise model of one run: ``uq.noise`` resolved against the scan, once (:func:`resolve_noise`), and what
    follows from it.

    Attributes
    ----------
    setting : str
        ``uq.noise`` as configured (``homoscedastic``, ``per_ray`` or ``auto``).
    model : NoiseModel
        What it resolved to: ``homoscedastic`` or ``per_ray``.
    reason : str
        Why, in one line (recorded in ``metrics.json["uq"]["stats"]["noise"]``).
    measurement_variances : torch.Tensor or None
        ``per_ray``: the scan's per-measurement variances as given (``measurement_shape``, data units²,
        :attr:`ctuq.data.CTData.variances`); ``None`` otherwise.
    relative : torch.Tensor or None
        ``per_ray``: ``d = v / mean(v)`` ``(c,)`` float64 on the CPU, mean 1, so ``σ²`` stays the mean noise variance.
    normaliser : float or None
        ``per_ray``: ``mean(v)`` (data units²), what other rows' variances are divided by too
        (:meth:`ctuq.inference.DiagonalGaussianLikelihood.noise_variance_of`).
    """

    setting: str
    model: NoiseModel
    reason: str
    measurement_variances: torch.Tensor | None = None
    relative: torch.Tensor | None = None
    normaliser: float | None = None

    @property
    def automatic(self) -> bool:
        """The model was chosen by ``uq.noise = auto`` (worth a log line saying which)."""
        return self.setting == NoiseModel.AUTO

    def likelihood(self, sigma2: float, learn_noise: bool) -> GaussianLikelihood:
        """The likelihood of the linear model (``σ²`` in scaled data units²): ``N(0, σ² I)``, or ``N(0, σ² D)`` with
        ``D = diag(d)`` carrying :attr:`normaliser` (so it answers the held-out rows' noise variance itself)."""
        if self.relative is None:
            return GaussianLikelihood(sigma2, learn_noise)
        return DiagonalGaussianLikelihood(sigma2, learn_noise, variances=self.relative, normaliser=self.normaliser)

    def record(self) -> dict:
        """``{"setting", "model", "reason"}`` (plain strings), for ``metrics.json["uq"]["stats"]["noise"]``."""
        return {"setting": str(self.setting), "model": str(self.model), "reason": self.reason}


def resolve_noise(settings: UQConfig, variances, measurement_shape) -> ResolvedNoise:
    """``settings.noise`` (``uq.noise``) resolved against the scan's per-measurement variances ``variances``
    (``measurement_shape``, data units², :attr:`ctuq.data.CTData.variances`, or ``None``): the only place that reads
    it; everything downstream asks the returned :class:`ResolvedNoise` or the likelihood it builds.

    ``auto`` (the default) resolves to ``per_ray`` when the variances are given and every one is finite and positive,
    else to ``homoscedastic`` (the reason says which, in one line). An explicit ``per_ray`` with missing or unusable
    variances is refused: :class:`~ctuq.errors.CTUQError` naming ``uq.noise`` and the shape or value.
    """
    setting = NoiseModel(settings.noise)
    if setting == NoiseModel.HOMOSCEDASTIC:
        return ResolvedNoise(str(setting), setting, f"uq.noise = {setting}")
    if setting == NoiseModel.PER_RAY:
        reason = f"uq.noise = {setting}"
    elif variances is None:
        reason = "uq.noise = auto: the scan has no per-measurement variances (no raw counts)"
        return ResolvedNoise(str(setting), NoiseModel.HOMOSCEDASTIC, reason)
    else:
        reason = "uq.noise = auto: per-ray variances from the scan's photon statistics"
    try:
        v = _checked_variances(variances, measurement_shape, setting)
    except CTUQError as err:
        if setting == NoiseModel.PER_RAY:
            raise
        return ResolvedNoise(str(setting), NoiseModel.HOMOSCEDASTIC, f"{err}; using homoscedastic noise")
    mean = v.mean()
    return ResolvedNoise(str(setting), NoiseModel.PER_RAY, reason, variances, v / mean, float(mean))


def _checked_variances(variances, measurement_shape, noise) -> torch.Tensor:
    """``variances`` flat float64 on the CPU; :class:`CTUQError` naming ``uq.noise = noise`` when they are missing,
    of another shape than ``measurement_shape``, or not all finite and positive."""
    shape = tuple(int(n) for n in measurement_shape)
    if variances is None:
        raise CTUQError(
            f"uq.noise = '{noise}' needs the scan's per-measurement variances (photon statistics: raw counts, flats "
            "and darks, CTData.variances), but none were given; use uq.noise=homoscedastic for data without counts"
        )
    if not isinstance(variances, torch.Tensor) or tuple(variances.shape) != shape:
        got = tuple(variances.shape) if isinstance(variances, torch.Tensor) else type(variances).__name__
        raise CTUQError(f"uq.noise = '{noise}': the variances have shape {got}, the sinogram {shape}")
    v = variances.detach().to("cpu", torch.float64).reshape(-1)
    bad = ~(torch.isfinite(v) & (v > 0))
    if bad.any():
        i = int(bad.nonzero()[0])
        raise CTUQError(
            f"uq.noise = '{noise}': {int(bad.sum())} measurement variances are not finite and positive (first at "
            f"flat index {i} of the {shape} sinogram: {float(v[i])})"
        )
    return v
