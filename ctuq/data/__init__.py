"""Walnut data: the loader of the Der Sarkissian et al. (2019) cone-beam walnut layout, a synthetic walnut
phantom with exact line integrals, and a scan simulator that writes that layout (DESIGN.md §4).

* :func:`load_walnut_slice` / :func:`load_walnut_volume` → :class:`CTData` (operator, sinogram, ground truth);
  :func:`read_walnut_slice` / :func:`read_walnut_volume` do the same without building the operator.
* :func:`default_data_dir`: ``$CTUQ_DATA`` or the bundled simulated scan ``data/Walnut1``.
* :func:`walnut_phantom`, :class:`EllipsoidPhantom`, :class:`Ellipsoid`: phantoms (mm, mm⁻¹).
* :func:`simulate_scan`, :class:`SimulationParameters`, :data:`SCAN_PRESETS`: the simulator behind ``ctuq simulate``
  (walnut layout, ``scan.yaml`` + ``.npy``/TIFF, NXtomo).
* Other formats (``docs/data_formats.md``): :func:`load_data` / :func:`read_data` open any registered format
  (:data:`DATA_FORMATS`: the walnut folder, a ``scan.yaml`` (:func:`open_scan_file`), an NXtomo file
  (:func:`open_nxtomo`)) into the same :class:`CTData`; :func:`to_astra` / :func:`from_astra` move a loaded
  scan's geometry to ASTRA (and CIL) and back.
"""

from ctuq.data.astra_geometry import circular_vectors, from_astra, load_astra_vectors, save_astra_vectors, to_astra
from ctuq.data.formats import DATA_FORMATS, detect_format, load_data, open_scan, read_data
from ctuq.data.nxtomo import NXtomoError, open_nxtomo
from ctuq.data.phantom import Ellipsoid, EllipsoidPhantom, rotation_from_euler, walnut_phantom
from ctuq.data.projections import ProjectionScan, ScanFormatError
from ctuq.data.scan_file import ScanFileError, open_scan_file
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
    "DATA_FORMATS",
    "detect_format",
    "open_scan",
    "load_data",
    "read_data",
    "ProjectionScan",
    "ScanFormatError",
    "ScanFileError",
    "NXtomoError",
    "open_scan_file",
    "open_nxtomo",
    "to_astra",
    "from_astra",
    "circular_vectors",
    "save_astra_vectors",
    "load_astra_vectors",
]
