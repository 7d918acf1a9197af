"""Default stream-session settings, in a module without heavy imports (the CLI reads them for its help)."""

# Change-mask threshold: mean absolute difference per cell, 0-255 pixel levels (see incrinf.stream.change_mask).
DEFAULT_THRESHOLD = 10.0
# Change-mask cell side in pixels: 16 divides common input sizes (224 = 14 x 16) and the strides of CNN stages
# up to 16, so a cell maps onto whole positions of those feature maps.
DEFAULT_CELL = 16
# Feature threshold of still-camera frames: recomputed positions whose features moved by at most this share of
# the tensor's mean magnitude stop spreading. On EfficientNet-Lite0 / carphone (benchmarks/stream.py) it cuts
# the FLOPs about 7x at a mean output error about that of reusing the previous frame's output; 0 propagates
# changes exactly. Frames the camera moved in propagate exactly by default (their cache is approximate already).
DEFAULT_FEATURE_THRESHOLD = 0.35
