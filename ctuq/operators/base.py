"""The one ray-transform interface every backend implements.

Notation (DESIGN.md §1): ``T`` maps an image ``x`` (``image_shape``, e.g. ``(H, W)`` pixels or
``(D, H, W)`` voxels) to measurements ``y`` (``measurement_shape``, angle-major: ``(n_angles, n_det)``
in 2D, ``(n_angles, n_rows, n_cols)`` in 3D). Values are line integrals in the geometry's length unit
(mm for walnut data) of an image given in inverse length units (attenuation per mm).

Every call accepts a leading batch dimension, and the flat variants work on ``(B, d_x)`` / ``(B, c)``,
which is what the inference core sees. ``forward`` and ``adjoint`` are differentiable: the backward of
``T`` is ``Tᵀ`` and vice versa, so ``T`` can sit inside a DIP loss; ``torch.func`` transforms work too
(``vmap`` folds the mapped dimension into the batch dimension: one backend call). Backends implement only
``_forward_raw`` and ``_adjoint_raw`` on contiguous ``(B, *shape)`` tensors with no autograd.

A backend that :func:`~ctuq.operators.make_ray_transform` can build by name also sets the class attributes
``geometry_kinds``, ``devices``, ``dtypes``, ``exact_adjoint`` and ``auto_ndims`` and implements the class
methods :meth:`RayTransform.available` (its availability flag) and :meth:`RayTransform.from_geometry`; it is then
one line ``RAY_TRANSFORMS.register(...)`` (:data:`ctuq.registry.RAY_TRANSFORMS`, in :mod:`ctuq.operators.registry`),
and the shipped contract (:class:`ctuq.testing.RayTransformContract`, run over every registered backend by
``tests/operators/test_ray_transform_contract.py``) checks it wherever it is available.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence
from typing import ClassVar

import numpy as np
import torch

__all__ = ["RayTransform", "ShapeError"]


class ShapeError(ValueError):
    """A tensor handed to an operator has a shape that does not fit its geometry."""


class _Project(torch.autograd.Function):
    """y = T x, with grad_x = Tᵀ grad_y."""

    @staticmethod
    def forward(x: torch.Tensor, op: RayTransform) -> torch.Tensor:  # type: ignore[override]
        return op._forward_raw(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.op = inputs[1]

    @staticmethod
    def backward(ctx, grad_y):
        return ctx.op._adjoint_raw(grad_y.contiguous()), None

    @staticmethod
    def jvp(ctx, x_dot, _op_dot):
        # T is linear, so its forward-mode derivative is T itself.
        return ctx.op._forward_raw(x_dot.contiguous())

    @staticmethod
    def vmap(info, in_dims, x, op):
        # torch.func.vmap: fold the vmapped dimension into the operator's own batch dimension (one call).
        return _vmap_through(_Project, in_dims[0], x, op)


def _vmap_through(fn, x_dim, t, op):
    if x_dim is None:
        return fn.apply(t, op), None
    t = t.movedim(x_dim, 0)
    v, b = t.shape[0], t.shape[1]
    out = fn.apply(t.reshape(v * b, *t.shape[2:]).contiguous(), op)
    return out.reshape(v, b, *out.shape[1:]), 0


class _BackProject(torch.autograd.Function):
    """x = Tᵀ y, with grad_y = T grad_x."""

    @staticmethod
    def forward(y: torch.Tensor, op: RayTransform) -> torch.Tensor:  # type: ignore[override]
        return op._adjoint_raw(y)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.op = inputs[1]

    @staticmethod
    def backward(ctx, grad_x):
        return ctx.op._forward_raw(grad_x.contiguous()), None

    @staticmethod
    def jvp(ctx, y_dot, _op_dot):
        return ctx.op._adjoint_raw(y_dot.contiguous())

    @staticmethod
    def vmap(info, in_dims, y, op):
        return _vmap_through(_BackProject, in_dims[0], y, op)


class RayTransform(abc.ABC):
    """Abstract ray transform ``T`` (``c × d_x``) with its exact adjoint.

    Attributes
    ----------
    image_shape : tuple[int, ...]
        Shape of one image, ``(H, W)`` or ``(D, H, W)``; ``d_x = prod(image_shape)``.
    measurement_shape : tuple[int, ...]
        Shape of one sinogram, angle-major: ``(n_angles, n_det)`` or ``(n_angles, n_rows, n_cols)``.
    angles : numpy.ndarray
        ``(n_angles,)`` projection angles in radians (for vector geometries: the source angle
        about the rotation axis, for information and plotting only).
    device : torch.device
        Where inputs and outputs live.
    volume : ctuq.geometry.VolumeGeometry
        The pixel grid (mm) of backends built from geometries (``None`` for ad-hoc test operators).
    geometry : ctuq.geometry.ProjectionGeometry
        The acquisition geometry (mm) of backends built from geometries (``None`` otherwise).
    """

    image_shape: tuple[int, ...]
    measurement_shape: tuple[int, ...]
    angles: np.ndarray
    device: torch.device
    dtype: torch.dtype = torch.float32
    volume = None
    geometry = None

    # ------------------------------------------------------------------ what a registered backend declares
    #: :class:`~ctuq.geometry.ProjectionGeometry` kinds that :meth:`from_geometry` builds an operator for.
    geometry_kinds: ClassVar[tuple[str, ...]] = ()
    #: Device types (``"cpu"``, ``"cuda"``) the operator runs on.
    devices: ClassVar[tuple[str, ...]] = ()
    #: Floating-point dtypes the operator computes in.
    dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32,)
    #: Whether ``adjoint`` is the exact transpose of ``forward`` (to rounding); ``False``: only to the accuracy
    #: of the backend's interpolation (ASTRA's voxel-driven back-projection, ~1–3 % in ⟨x, Tᵀy⟩).
    exact_adjoint: ClassVar[bool] = True
    #: Image dimensions (2, 3) for which ``backend="auto"`` picks this backend (the first in registry order).
    auto_ndims: ClassVar[tuple[int, ...]] = ()

    @classmethod
    def available(cls) -> bool:
        """The backend's availability flag: whether it can run on this machine now (libraries, devices)."""
        return True

    @classmethod
    def from_geometry(
        cls, volume, geometry, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
    ) -> RayTransform:
        """The operator for ``volume`` (pixel grid, mm) and ``geometry`` (mm) on ``device``; a registered backend
        overrides this and raises ``ValueError``/``RuntimeError`` naming what it cannot build."""
        raise NotImplementedError(f"{cls.__name__} is not a registered ray-transform backend")

    # ------------------------------------------------------------------ backend hooks
    @abc.abstractmethod
    def _forward_raw(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, *image_shape)`` → ``(B, *measurement_shape)``, no autograd, contiguous input."""

    @abc.abstractmethod
    def _adjoint_raw(self, y: torch.Tensor) -> torch.Tensor:
        """``(B, *measurement_shape)`` → ``(B, *image_shape)``, no autograd, contiguous input."""

    @abc.abstractmethod
    def subset(self, angle_indices: Sequence[int]) -> RayTransform:
        """Operator restricted to the given angles (in the given order).

        Its output equals ``self.forward(x)[:, angle_indices]``; used by experimental design.
        """

    @abc.abstractmethod
    def to(self, device: torch.device | str) -> RayTransform:
        """A copy of this operator whose inputs and outputs live on ``device``."""

    # ------------------------------------------------------------------ derived sizes
    @property
    def n_angles(self) -> int:
        return int(self.measurement_shape[0])

    @property
    def d_x(self) -> int:
        """Number of pixels/voxels of one image."""
        return int(math.prod(self.image_shape))

    @property
    def c(self) -> int:
        """Number of measurements of one sinogram."""
        return int(math.prod(self.measurement_shape))

    @property
    def ndim(self) -> int:
        """2 for slices, 3 for volumes."""
        return len(self.image_shape)

    # ------------------------------------------------------------------ public API
    def _batched(self, t: torch.Tensor, shape: tuple[int, ...], what: str) -> tuple[torch.Tensor, bool]:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{type(self).__name__}: {what} must be a torch.Tensor, got {type(t).__name__}")
        if tuple(t.shape) == shape:
            return t.unsqueeze(0), True
        if t.ndim == len(shape) + 1 and tuple(t.shape[1:]) == shape:
            return t, False
        raise ShapeError(
            f"{type(self).__name__}: {what} has shape {tuple(t.shape)}; expected {shape} "
            f"or (batch, {', '.join(map(str, shape))})"
        )

    def _check_device(self, t: torch.Tensor, what: str) -> torch.Tensor:
        if t.device.type != self.device.type:
            raise ValueError(
                f"{type(self).__name__} lives on {self.device}, but the {what} is on {t.device}; "
                f"move one of them (op.to(device) or tensor.to(device))"
            )
        if not t.is_floating_point():
            # A silent cast would drop the imaginary part of complex data and hide integer/bool mix-ups.
            raise TypeError(
                f"{type(self).__name__}: the {what} has dtype {t.dtype}; expected a real floating-point tensor "
                f"(it is cast to the operator's {self.dtype})"
            )
        if t.dtype != self.dtype:
            t = t.to(self.dtype)
        return t

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Project images: ``(B, *image_shape)`` or ``image_shape`` → ``(B, *measurement_shape)``
        (batch dimension dropped again when the input had none). Differentiable."""
        xb, squeeze = self._batched(x, self.image_shape, "image")
        xb = self._check_device(xb, "image").contiguous()
        y = _Project.apply(xb, self)
        return y[0] if squeeze else y

    __call__ = forward

    def adjoint(self, y: torch.Tensor) -> torch.Tensor:
        """Back-project sinograms (exact adjoint ``Tᵀ``): ``(B, *measurement_shape)`` →
        ``(B, *image_shape)``. Differentiable."""
        yb, squeeze = self._batched(y, self.measurement_shape, "sinogram")
        yb = self._check_device(yb, "sinogram").contiguous()
        x = _BackProject.apply(yb, self)
        return x[0] if squeeze else x

    def forward_flat(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, d_x)`` → ``(B, c)``: the flat, angle-major view used by the inference core."""
        if x.ndim != 2 or x.shape[1] != self.d_x:
            raise ShapeError(f"{type(self).__name__}.forward_flat: expected (batch, {self.d_x}), got {tuple(x.shape)}")
        return self.forward(x.reshape(x.shape[0], *self.image_shape)).reshape(x.shape[0], self.c)

    def adjoint_flat(self, y: torch.Tensor) -> torch.Tensor:
        """``(B, c)`` → ``(B, d_x)``."""
        if y.ndim != 2 or y.shape[1] != self.c:
            raise ShapeError(f"{type(self).__name__}.adjoint_flat: expected (batch, {self.c}), got {tuple(y.shape)}")
        return self.adjoint(y.reshape(y.shape[0], *self.measurement_shape)).reshape(y.shape[0], self.d_x)

    def operator_norm(self, n_iter: int = 30, seed: int = 0) -> float:
        """Estimate ``‖T‖₂`` by power iteration on ``TᵀT`` (used for step sizes of classical solvers)."""
        gen = torch.Generator(device="cpu").manual_seed(seed)
        x = torch.randn((1, *self.image_shape), generator=gen, dtype=self.dtype).to(self.device)
        x /= x.norm()
        norm_sq = 0.0
        with torch.no_grad():
            for _ in range(n_iter):
                z = self._adjoint_raw(self._forward_raw(x).contiguous())
                norm_sq = float(z.norm())
                if norm_sq == 0.0:
                    return 0.0
                x = z / norm_sq
        return math.sqrt(norm_sq)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(image_shape={self.image_shape}, measurement_shape={self.measurement_shape}, "
            f"device={self.device})"
        )
