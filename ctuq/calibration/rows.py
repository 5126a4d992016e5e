"""The held-out rows on disk (a run folder's ``heldout_rows.npz``): everything the check's statistics need, so that
``ctuq uq RUN --check`` and the calibration study rescore a finished run in seconds.

One ``.npz``: float64 ``residual``, ``variance``, ``noise_variance`` (per row), ``photon_variance`` (when the scan
has counts), ``bias_weight`` (rows saved since the bias model), int64 ``groups``, ``meta`` (the rows' sizes and
provenance as a JSON string), and per image feature of the calibration methods ``feature_<name>`` (the map) and
``feature_weight_<name>`` (its row weights).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ctuq.calibration.check import HeldoutRows
from ctuq.errors import OutDirError
from ctuq.utils import atomic_path

__all__ = ["write_rows", "read_rows", "ROW_KEYS", "META_KEYS"]

#: The arrays every rows file holds.
ROW_KEYS = ("residual", "variance", "noise_variance", "groups")
#: The :attr:`HeldoutRows.meta` entries saved with them, in this order.
META_KEYS = ("n_samples", "n_angles", "n_used_angles", "noise_model", "command")


def write_rows(path: Path, rows: HeldoutRows) -> None:
    """Write ``rows`` (arrays and :data:`META_KEYS` of its meta) to ``path`` atomically."""
    arrays = {
        "residual": np.asarray(rows.residual, np.float64),
        "variance": np.asarray(rows.variance, np.float64),
        "noise_variance": np.broadcast_to(np.asarray(rows.noise_variance, np.float64), rows.residual.shape),
        "groups": np.asarray(rows.groups, np.int64),
        "meta": np.asarray(json.dumps({k: rows.meta[k] for k in META_KEYS if k in rows.meta})),
    }
    if rows.photon_variance is not None:
        arrays["photon_variance"] = np.asarray(rows.photon_variance, np.float64)
    if rows.bias_weight is not None:
        arrays["bias_weight"] = np.asarray(rows.bias_weight, np.float64)
    for name, image in rows.features.items():
        arrays[f"feature_{name}"] = np.asarray(image, np.float64)
        arrays[f"feature_weight_{name}"] = np.asarray(rows.feature_weights[name], np.float64)
    with atomic_path(Path(path)) as tmp, open(tmp, "wb") as fh:
        np.savez(fh, **arrays)


def read_rows(path: Path) -> HeldoutRows | None:
    """The rows saved at ``path`` (unscored, :attr:`HeldoutRows.meta` from the file), or ``None`` when there is no
    such file (a run made before the file existed, or a scan without unused angles).
    :class:`~ctuq.errors.OutDirError` naming the file when it is unreadable, lacks an array or holds bias weights
    that are not one per row."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        meta = json.loads(str(arrays["meta"])) if "meta" in arrays else None
    except (OSError, ValueError, EOFError) as exc:
        raise OutDirError(f"{path}: unreadable held-out rows ({type(exc).__name__}: {exc})") from None
    missing = [k for k in (*ROW_KEYS, "meta") if k not in arrays]
    if missing or not isinstance(meta, dict):
        raise OutDirError(f"{path}: not a held-out rows file (no {', '.join(missing or ['meta dict'])})")
    weight = arrays.get("bias_weight")
    if weight is not None and weight.shape != arrays["residual"].shape:
        raise OutDirError(
            f"{path}: bias_weight has shape {weight.shape}, the residual {arrays['residual'].shape} (one per row)"
        )
    names = [k.removeprefix("feature_weight_") for k in arrays if k.startswith("feature_weight_")]
    for name in names:
        if f"feature_{name}" not in arrays or arrays[f"feature_weight_{name}"].shape != arrays["residual"].shape:
            raise OutDirError(f"{path}: feature {name!r} lacks its map or has not one weight per row")
    return HeldoutRows(
        arrays["residual"],
        arrays["variance"],
        arrays["noise_variance"],
        arrays["groups"],
        arrays.get("photon_variance"),
        weight,  # absent from rows saved before the bias model
        meta,
        features={name: arrays[f"feature_{name}"] for name in names},
        feature_weights={name: arrays[f"feature_weight_{name}"] for name in names},
    )
