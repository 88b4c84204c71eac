"""One training step and what surrounds it: losses, the compiled train step, config validation
and the metrics sinks."""
