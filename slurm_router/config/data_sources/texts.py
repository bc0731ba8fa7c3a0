"""data.kind=stdlib (the standard library's own source files as text, no data.path) and data.kind=text_dir
(every text file of a folder, data.path)."""

from slurm_router.config.data_sources import TEXT, DataSource

SOURCES = {"stdlib": DataSource(reads=TEXT), "text_dir": DataSource(reads=(*TEXT, "path"))}
