"""Scans in and out: every scan format behind one interface, the loaded problem, phantoms and a scan simulator
(DESIGN.md §4).

* :class:`CTData` (:mod:`ctuq.data.problem`): the loaded problem every format produces — operator, sinogram,
  per-measurement variances, ground truth, and the held-out rows of the angles a run does not use
  (:class:`HeldoutData`).
* :class:`ScanSource` (:mod:`ctuq.data.source`): what an opened scan offers; :mod:`ctuq.data.loader`
  (:func:`load_slice`, :func:`load_volume`, :func:`read_slice`, :func:`read_volume`) cuts any source into a
  :class:`CTData`.
* :data:`DATA_FORMATS` (:mod:`ctuq.data.formats`): the registry of :class:`ScanFormat` classes — the walnut folder
  (:mod:`ctuq.data.walnut`), ``scan.yaml`` (:mod:`ctuq.data.scan_file`), NXtomo (:mod:`ctuq.data.nxtomo`) — each
  one module that detects, opens and writes its layout; :func:`load_data` / :func:`read_data` open any of them
  (a format's source, e.g. :class:`WalnutScan`, goes to the loader directly); :func:`default_data_dir`:
  ``$CTUQ_DATA`` or the bundled simulated scan ``data/Walnut1``.
* :func:`walnut_phantom`, :class:`EllipsoidPhantom`, :class:`Ellipsoid`: phantoms (mm, mm⁻¹).
* :func:`simulate_scan`, :class:`SimulationParameters`, :data:`SCAN_PRESETS`: the simulator behind ``ctuq simulate``,
  writing through the format registry (``docs/data_formats.md``).
* :func:`to_astra` / :func:`from_astra` move a loaded scan's geometry to ASTRA (and CIL) and back.
"""

import importlib

# Where each name lives; importing this package imports none of them (the command line reads
# ctuq.data.presets and ctuq.data.walnut_records without paying for torch): the first read of a name imports
# its module (PEP 562).
_HOMES = {
    **dict.fromkeys(
        ("circular_vectors", "from_astra", "load_astra_vectors", "save_astra_vectors", "to_astra"),
        "ctuq.data.astra_geometry",
    ),
    **dict.fromkeys(
        ("DATA_FORMATS", "detect_format", "load_data", "open_scan", "read_data", "write_layouts"), "ctuq.data.formats"
    ),
    **dict.fromkeys(("area_average", "load_slice", "load_volume", "read_slice", "read_volume"), "ctuq.data.loader"),
    **dict.fromkeys(("NXtomoError", "NXtomoFormat", "open_nxtomo"), "ctuq.data.nxtomo"),
    **dict.fromkeys(("Ellipsoid", "EllipsoidPhantom", "rotation_from_euler", "walnut_phantom"), "ctuq.data.phantom"),
    **dict.fromkeys(("SCAN_PRESETS",), "ctuq.data.presets"),
    **dict.fromkeys(("CTData", "HeldoutData"), "ctuq.data.problem"),
    **dict.fromkeys(("ProjectionScan", "ScanFormatError"), "ctuq.data.projections"),
    **dict.fromkeys(("ScanFileError", "ScanYamlFormat", "open_scan_file"), "ctuq.data.scan_file"),
    **dict.fromkeys(("CircularOrbit", "ScanContent", "ScanFormat", "ScanOrbit", "ScanWriter"), "ctuq.data.scan_format"),
    **dict.fromkeys(("SimulationParameters", "orbit_vectors", "simulate_scan"), "ctuq.data.simulate"),
    **dict.fromkeys(("ScanSource",), "ctuq.data.source"),
    **dict.fromkeys(
        (
            "WalnutFormat",
            "WalnutFormatError",
            "WalnutScan",
            "default_data_dir",
        ),
        "ctuq.data.walnut",
    ),
}


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'ctuq.data' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)


__all__ = [
    "CTData",
    "HeldoutData",
    "ScanSource",
    "ScanFormat",
    "ScanContent",
    "ScanOrbit",
    "ScanWriter",
    "CircularOrbit",
    "load_slice",
    "load_volume",
    "read_slice",
    "read_volume",
    "WalnutFormat",
    "WalnutFormatError",
    "WalnutScan",
    "area_average",
    "default_data_dir",
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
    "write_layouts",
    "ProjectionScan",
    "ScanFormatError",
    "ScanFileError",
    "ScanYamlFormat",
    "NXtomoError",
    "NXtomoFormat",
    "open_scan_file",
    "open_nxtomo",
    "to_astra",
    "from_astra",
    "circular_vectors",
    "save_astra_vectors",
    "load_astra_vectors",
]
