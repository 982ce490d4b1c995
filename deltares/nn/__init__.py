"""The model's chain: config -> routing -> residual plan -> router (layers) -> decoder layer -> depth pass -> model;
plus the public depth-routing API (routed, nnx) and the losses."""
