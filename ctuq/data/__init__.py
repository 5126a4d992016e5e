"""Walnut data: the loader of the Der Sarkissian et al. (2019) cone-beam walnut layout, a synthetic walnut
phantom with exact line integrals, and a scan simulator that writes that layout (DESIGN.md §4).

* :func:`load_walnut_slice` / :func:`load_walnut_volume` → :class:`CTData` (operator, sinogram, ground truth);
  :func:`read_walnut_slice` / :func:`read_walnut_volume` do the same without building the operator.
* :func:`default_data_dir`: ``$CTUQ_DATA`` or the bundled simulated scan ``data/Walnut1``.
* :func:`walnut_phantom`, :class:`EllipsoidPhantom`, :class:`Ellipsoid`: phantoms (mm, mm⁻¹).
* :func:`simulate_scan`, :class:`SimulationParameters`, :data:`SCAN_PRESETS`: the simulator behind ``ctuq simulate``.
"""

from ctuq.data.phantom import Ellipsoid, EllipsoidPhantom, rotation_from_euler, walnut_phantom
from ctuq.data.simulate import SCAN_PRESETS, SimulationParameters, orbit_vectors, simulate_scan
from ctuq.data.walnut import (
    CTData,
    WalnutFormatError,
    WalnutScan,
    area_average,
    default_data_dir,
    load_walnut_slice,
    load_walnut_volume,
    read_walnut_slice,
    read_walnut_volume,
)

__all__ = [
    "CTData",
    "WalnutFormatError",
    "WalnutScan",
    "area_average",
    "default_data_dir",
    "load_walnut_slice",
    "load_walnut_volume",
    "read_walnut_slice",
    "read_walnut_volume",
    "Ellipsoid",
    "EllipsoidPhantom",
    "rotation_from_euler",
    "walnut_phantom",
    "SCAN_PRESETS",
    "SimulationParameters",
    "orbit_vectors",
    "simulate_scan",
]
