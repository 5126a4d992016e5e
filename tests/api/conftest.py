"""The scan and the finished run that the API tests share: the fan-beam case of :mod:`api_cases` given as arrays
(``Scan.from_astra``) and its run with uncertainty in memory (``ctuq.reconstruct(config="tiny", set=SET)``, ~8 s),
made once per session for the modules that read it (acceptance, posterior, held-out check). Read them; a test that
changes a run works on a copy (``run.save`` or ``ctuq.uncertainty``, which copies)."""

import pytest
from api_cases import SET, astra_sino, ellipses, geometry_2d

import ctuq


@pytest.fixture(scope="session")
def fan_case():
    """``(sinogram, proj_geom, vol_geom, image)``: ASTRA's ``line_fanflat`` projection of :func:`api_cases.ellipses`
    over 40 angles × 48 columns (the scan ctuq never saw)."""
    image = ellipses()
    proj_geom, vol_geom = geometry_2d("fanflat")
    return astra_sino(image, proj_geom, vol_geom), proj_geom, vol_geom, image


@pytest.fixture(scope="session")
def fan_scan(fan_case):
    sino, proj_geom, vol_geom, image = fan_case
    return ctuq.Scan.from_astra(sino, proj_geom, vol_geom, ground_truth=image)


@pytest.fixture(scope="session")
def fan_run(fan_scan):
    """The finished in-memory run of :func:`fan_scan`: 20 of its 40 angles used (``tiny``'s
    ``data.angular_subsampling = 2``), the other 20 held out; the ``bias`` calibration applied."""
    return ctuq.reconstruct(fan_scan, config="tiny", set=SET, progress=False)


@pytest.fixture(scope="session")
def fan_run_saved(fan_run, tmp_path_factory):
    """:func:`fan_run` saved as a run folder (read it; copy it to change it)."""
    return fan_run.save(tmp_path_factory.mktemp("fan_run") / "run")
