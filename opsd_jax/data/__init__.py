"""From data sets to fixed-shape packs, on the host (numpy + PIL): sources, the grain pipeline,
image preprocessing, packing, the OPSD / SFT pack views, pack shapes and the offline teacher cache."""
