"""What crosses the engine's edge: request and loss specs, bounds, options, errors."""
