"""Where the walnut data set (Der Sarkissian et al. 2019) lives: its Zenodo records and the server, as plain data
(``ctuq fetch`` lists them in its ``--help`` without loading the downloader, :mod:`ctuq.data.fetch`)."""

from __future__ import annotations

import dataclasses

__all__ = ["DEFAULT_BASE_URL", "BASE_URL_ENV", "WalnutRecord", "WALNUT_RECORDS", "N_WALNUTS"]

DEFAULT_BASE_URL = "https://zenodo.org"
BASE_URL_ENV = "CTUQ_ZENODO_URL"


@dataclasses.dataclass(frozen=True)
class WalnutRecord:
    """One Zenodo record of the data set: walnuts ``first … last`` (inclusive), its concept record id (the
    published DOI ``10.5281/zenodo.{concept}``) and, where confirmed, the id of the version that holds the files."""

    first: int
    last: int
    concept: int
    version: int | None = None

    @property
    def doi_url(self) -> str:
        """The published DOI as a URL (resolves to the record page in a browser)."""
        return f"https://doi.org/10.5281/zenodo.{self.concept}"


# The DOIs of the data set's README (cicwi/WalnutReconstructionCodes) and the paper's data records.
WALNUT_RECORDS: tuple[WalnutRecord, ...] = (
    WalnutRecord(1, 8, 2686725, 2686726),
    WalnutRecord(9, 16, 2686970),
    WalnutRecord(17, 24, 2687386),
    WalnutRecord(25, 32, 2687634),
    WalnutRecord(33, 37, 2687896),
    WalnutRecord(38, 42, 2688111),
)
N_WALNUTS = WALNUT_RECORDS[-1].last
