"""jaxreplay."""
