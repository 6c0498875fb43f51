"""What the coordinator (``fl_server``) shares with the device, so that both sides write and read the same bytes
and compute the same numbers: atomic file writes, the bundle manifest's name and file hash, the input layouts (and
a batch's values per channel), strict JSON, the binary weights format, BTFL's DLEs and ODPFL-HN's privatized set embedding. A device application
needs none of it (its way in is :func:`edge_sdk.open_bundle`)."""
from __future__ import annotations

from edge_sdk._atomic import atomic_link, atomic_path, atomic_write_bytes, atomic_write_text, move
from edge_sdk._btfl import average_dles, fit_dle
from edge_sdk._bundle import BUNDLE_FORMAT, MANIFEST, sha256_file
from edge_sdk._bundle import FROZEN_LOCATION, FROZEN_SOURCES
from edge_sdk._dp import privatize_pooled
from edge_sdk._preprocess import LAYOUTS, RawInput, channel_values
from edge_sdk._strictjson import dumps as strict_dumps, finite as json_finite, loads as strict_loads
from edge_sdk._tensors import MEDIA_TYPE as WEIGHTS_MEDIA_TYPE, encode_header as encode_weights_header

__all__ = ["BUNDLE_FORMAT", "LAYOUTS", "MANIFEST", "WEIGHTS_MEDIA_TYPE", "RawInput", "atomic_link", "atomic_path",
           "atomic_write_bytes", "atomic_write_text", "average_dles", "channel_values", "encode_weights_header",
           "fit_dle", "json_finite", "move", "privatize_pooled", "sha256_file", "strict_dumps", "strict_loads"]
__all__ += ["FROZEN_LOCATION", "FROZEN_SOURCES"]  # a step graph's frozen weights (edge_sdk._bundle)
