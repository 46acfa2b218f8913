"""Comparing replay settings: sweeps of runs, the report across run dirs, and the CLI verbs
(`jaxreplay sweep / report / theory`)."""
