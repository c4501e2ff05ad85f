"""The OpenAI-compatible HTTP server: `carpool serve`."""
