"""Host-side data preparation (numpy + PIL only): image preprocessing, patchify, packing."""
