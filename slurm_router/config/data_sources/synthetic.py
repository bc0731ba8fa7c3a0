"""data.kind=synthetic: token sequences with a controllable length distribution (benchmarks)."""

from slurm_router.config.data_sources import DataSource


def _unread(data) -> dict[str, str]:
    dist = data.get("length_dist")
    fix = f"data.length_dist={dist} does not use it: drop it, or set data.length_dist=lognormal"
    unused = {"fixed": ("sigma", "min_len"), "uniform": ("sigma",)}.get(dist, ())
    return {key: fix for key in unused}


SOURCE = DataSource(
    reads=("kind", "max_len", "val_fraction", "n_samples", "length_dist", "mean_len", "sigma", "min_len"),
    unread=_unread,
)
