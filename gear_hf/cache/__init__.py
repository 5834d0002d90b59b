"""The GEAR KV cache: `GearCache` (the transformers Cache protocol), `GearLayer` (one layer's streams),
`RowLayout` (where each row's tokens are, planned once per step), `Stream` (keys or values of a layer) and the
memory report. Data flows store -> attend -> compress; see gear_cache.py."""

from .gear_cache import GearCache, _text_config  # noqa: F401  (_text_config: diagnostics)
from .layer import GearLayer, stream_specs
from .layout import RowCounts, RowLayout
from .memory import COMPONENTS

_stream_specs = stream_specs  # earlier name (tests, scripts)

__all__ = ["GearCache", "GearLayer", "RowLayout", "RowCounts", "COMPONENTS", "stream_specs"]
